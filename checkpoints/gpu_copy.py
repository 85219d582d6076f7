"""Device-to-host copies of a checkpoint's tensors that do not stall the training loop.

:class:`checkpoints.async_save.StateSnapshot` copies the state into reused
pinned host buffers. Copied on the training stream and waited for, the loop
would stand still for the whole device-to-host transfer (about 0.1 s for
2.4 GB at 25 GB/s, more than two steps of a 200M-parameter model on an H100).
:class:`SideStreamCopy` runs the copies on a side CUDA stream instead,
overlapped with the next forward and backward:

* parameters and optimizer state do not change until the next
  ``optimizer.step()``: :meth:`SideStreamCopy.guard` registers an optimizer
  pre-step hook that makes the training stream wait for the copy (on the
  device: the host goes on queueing the step's kernels), so the step's kernels
  start after it, and the loop loses only what is left of the copy then
  (nothing if forward and backward took longer);
* tensors that change in between (module buffers such as running statistics,
  which the forward pass updates in place) are first cloned on the training
  stream, in stream order, and the clone is copied; so are all tensors with
  ``stage_on_device=True``, which trades device memory (one reused staging
  buffer per dtype) for a loop that never waits at all;
* CPU tensors are copied at once, as before (nothing to overlap with).

:func:`copy_path` decides which way a snapshot goes. The caller (the
snapshot, for the checkpointer) hands the finished copy to its writer thread,
which calls :meth:`SideStreamCopy.wait` before reading the host buffers; the
buffers are the caller's and are reused from one save to the next.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["CopyPath", "SideStreamCopy", "copy_path", "stable_tensors"]

log = logging.getLogger(__name__)


class CopyPath(str, enum.Enum):
    """How a snapshot's tensors reach its host buffers."""

    #: Every tensor on the CPU: copied at once, on the calling thread.
    HOST = "host"
    #: Device tensors, copied on the training stream and waited for before the
    #: snapshot returns (no optimizer guards the copy, several devices, no CUDA).
    WAIT = "wait"
    #: Device tensors on one CUDA device: copied on a side stream, overlapped with
    #: the next forward and backward, the optimizer's next step ordered after it.
    SIDE_STREAM = "side-stream"


def copy_path(
    devices: Iterable[torch.device], *, guarded: bool, cuda_available: bool
) -> CopyPath:
    """Which way a snapshot of tensors on ``devices`` takes.

    Args:
        devices: the devices of the state's tensors.
        guarded: whether an optimizer will order its next step after the copy
            (without one, nothing says when parameters may change).
        cuda_available: ``torch.cuda.is_available()``.
    """
    off_host = {d for d in devices if d.type != "cpu"}
    if not off_host:
        return CopyPath.HOST
    one_cuda_device = len(off_host) == 1 and next(iter(off_host)).type == "cuda"
    if guarded and cuda_available and one_cuda_device:
        return CopyPath.SIDE_STREAM
    return CopyPath.WAIT


def stable_tensors(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> set[int]:
    """Storage addresses of the tensors only ``optimizer.step()`` changes.

    The optimizer's parameters and state, and the model's frozen parameters
    (``requires_grad=False``: nothing steps them). Not the module buffers the
    forward updates, nor a trainable parameter another optimizer may step.
    """
    stable: set[int] = set()
    if model is not None:
        stable.update(p.data_ptr() for p in model.parameters() if not p.requires_grad)
    if optimizer is not None:
        for group in optimizer.param_groups:
            stable.update(p.data_ptr() for p in group["params"])
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    stable.add(value.data_ptr())
    return stable


class SideStreamCopy:
    """Copies device tensors into host buffers on a side stream; orders the next step after it.

    Safe to :meth:`wait` for from another thread (the writer) while the
    training thread steps: the copy's event is only forgotten once it is done.

    Args:
        stage_on_device: clone every device tensor on the training stream into
            reused device buffers first, then copy those: no wait in the loop at
            all, for the device memory of one more copy of the state.
        stream: the side stream (default: a new one on the sources' device).
    """

    def __init__(self, *, stage_on_device: bool = False, stream: Any = None) -> None:
        self._stage = stage_on_device
        self._stream = stream
        self._done: Any = None  # torch.cuda.Event of the copies in flight
        self._device: torch.device | None = None  # of the copies in flight
        self._staging: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def pending(self) -> bool:
        """Whether copies started by :meth:`start` may still be running."""
        return self._done is not None

    @property
    def stage_on_device(self) -> bool:
        """Whether device tensors are cloned into staging buffers first."""
        return self._stage

    def start(
        self,
        sources: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        stable: Iterable[int] = (),
    ) -> None:
        """Copy each source into its target (same shape), device ones on the side stream.

        Returns at once for device tensors; CPU tensors are copied before it returns.

        Args:
            sources: the state's tensors (device ones all on one CUDA device).
            targets: host tensors of the same shapes (pinned ones for device sources).
            stable: :func:`stable_tensors`: sources that only the optimizer step
                changes; other device sources are cloned on the training stream first.

        Raises:
            RuntimeError: a previous copy is still pending (call :meth:`wait`).
            ValueError: sources and targets do not pair, or the device sources
                are on more than one device.
        """
        if self._done is not None:
            raise RuntimeError("the previous copy is still in flight: wait() for it first")
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        on_device = [(s, t) for s, t in zip(sources, targets, strict=True) if s.is_cuda]
        with torch.no_grad():
            for source, target in zip(sources, targets, strict=True):
                if not source.is_cuda:
                    target.copy_(source)
            if not on_device:
                return
            devices = {s.device for s, _ in on_device}
            if len(devices) != 1:
                raise ValueError(f"device tensors on {len(devices)} devices: one at most")
            device = devices.pop()
            with torch.cuda.device(device):
                self._start_on(device, on_device, set(stable))

    def _start_on(
        self,
        device: torch.device,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        stable: set[int],
    ) -> None:
        training = torch.cuda.current_stream(device)
        copied = self._staged([s for s, _ in pairs], stable)
        side = self._side(device)
        side.wait_stream(training)  # the sources (and clones) as of now
        with torch.cuda.stream(side):
            for source, (original, target) in zip(copied, pairs, strict=True):
                if source is not original:
                    source.record_stream(side)  # not reused before the copy is done
                target.copy_(source, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
        self._device, self._done = device, done

    def wait(self) -> None:
        """Block until the copies are in the host buffers (no-op when none is pending)."""
        done = self._done
        if done is None:
            return
        done.synchronize()
        if self._done is done:  # forgotten only once it is done (another thread may wait too)
            self._done = None

    def order_step(self) -> None:
        """Make the training stream wait for the copies in flight (the host goes on).

        What the training stream runs from now on (the optimizer step's
        kernels) starts once the copies have read their sources. No-op when no
        copy is pending, or with ``stage_on_device`` (the copies read the
        staging buffers, which the step does not touch).
        """
        done = self._done
        if done is None or self._stage:
            return
        torch.cuda.current_stream(self._device).wait_event(done)

    def guard(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Order every ``optimizer.step()`` after the copy in flight (:meth:`order_step`).

        Returns:
            The hook's handle: ``remove()`` it when no copy will be started again.
        """

        def before_step(*_: Any) -> None:
            self.order_step()

        return optimizer.register_step_pre_hook(before_step)

    def _side(self, device: torch.device) -> Any:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._stream

    def _staged(self, sources: list[torch.Tensor], stable: set[int]) -> list[torch.Tensor]:
        """The tensors to copy from: the sources, or clones on the training stream."""
        if not self._stage:
            return [s if s.data_ptr() in stable else s.clone() for s in sources]
        need: dict[tuple[torch.dtype, torch.device], int] = {}
        for s in sources:
            key = (s.dtype, s.device)
            need[key] = need.get(key, 0) + s.numel()
        for key, numel in need.items():
            buffer = self._staging.get(key)
            if buffer is None or buffer.numel() != numel:
                self._staging[key] = torch.empty(numel, dtype=key[0], device=key[1])
        offsets = dict.fromkeys(need, 0)
        out = []
        for s in sources:
            key = (s.dtype, s.device)
            start = offsets[key]
            offsets[key] = start + s.numel()
            view = self._staging[key][start : start + s.numel()].view(s.shape)
            view.copy_(s)  # on the training stream: in order before the next step's kernels
            out.append(view)
        return out
