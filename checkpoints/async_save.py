"""Asynchronous saving: snapshot the state off the device, write it in the background.

The training loop is blocked only while :class:`StateSnapshot` copies every
tensor of the state into buffers it keeps from one save to the next (pinned
host memory when the state lives on a GPU). Allocating fresh buffers each time
costs more than the copy itself on CPU (page faults on hundreds of MB), which
is why they are kept; the checkpointer has another thread allocate and fault
them in (or pin them) before its first save (:meth:`StateSnapshot.prepare`),
so that even that save only copies.

State on a CUDA device, with the optimizer given to the snapshot, is not even
waited for: the device-to-host copy runs on a side stream while the next
forward and backward run, and an optimizer pre-step hook orders the next step
after it (:mod:`checkpoints.gpu_copy`); the writer waits for the copy
(:meth:`StateSnapshot.wait`) before it reads the buffers.

:class:`BackgroundWriter` then runs serialization, checksumming and disk writes
in one thread whose scheduling priority is lowered (Linux priorities are per
thread), so that on a machine with few cores the writer takes the CPU time the
training threads leave idle rather than slowing every step. Its heavy work
(``torch.save`` of large storages, CRC-32, ``write``) runs with the GIL
released.

Only one save is in flight at a time: the snapshot buffers are reused, so a new
snapshot must wait until the writer is done with the previous one. The
checkpointer decides whether to wait or to skip (see docs/checkpoints.md); the
snapshot itself refuses to be taken again before the writer released it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from checkpoints.errors import CheckpointStateError
from checkpoints.gpu_copy import CopyPath, SideStreamCopy, copy_path, stable_tensors

__all__ = ["WRITER_NICE", "BackgroundWriter", "StateSnapshot", "run_in_background"]

log = logging.getLogger(__name__)

#: Niceness of the writer thread (0 = as urgent as training, 19 = only idle CPU).
WRITER_NICE = 19

_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.Size)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the state tree: its index among the tensors."""

    index: int


#: The dtype and number of elements of each tensor of a state tree, in order.
_Layout = tuple[tuple[torch.dtype, int], ...]


def _layout(tensors: list[torch.Tensor]) -> _Layout:
    return tuple((t.dtype, t.numel()) for t in tensors)


class StateSnapshot:
    """Copies the tensors of a state tree into reusable host buffers, one per dtype.

    The tree may nest dicts (any keys), lists and tuples of tensors and plain
    values (numbers, strings, bytes, None, dtypes). Its tensors come back as views
    into one buffer per dtype, so ``torch.save`` writes each dtype as one record.

    The buffers are allocated by the first :meth:`take`, or ahead of it by a
    :meth:`prepare` job in the background, and again only when the tensors'
    dtypes or sizes change. A taken snapshot is *held* until :meth:`release`:
    the background writer releases it once ``torch.save`` is done with the
    buffers, and a :meth:`take` before that raises rather than overwrite a save
    in flight.

    With ``optimizer`` given, a state on one CUDA device is copied on a side
    stream (:data:`~checkpoints.gpu_copy.CopyPath.SIDE_STREAM`): :meth:`take`
    returns before the copy is done, the first such take registers a pre-step
    hook on the optimizer that orders its steps after the copy in flight, and
    :meth:`close` removes it. Whoever reads the buffers calls :meth:`wait` first.

    Args:
        model: the model whose parameters are in the state (tensors that only
            the optimizer's step changes are copied as they are; others, such as
            module buffers, are cloned on the training stream first).
        optimizer: the optimizer whose step may change the state's tensors; None:
            device tensors are copied and waited for before :meth:`take` returns.
        stage_on_device: on the side-stream path, clone the whole state into
            reused device buffers first (one more copy of it in device memory),
            so that the optimizer's step never waits for the device-to-host copy.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        stage_on_device: bool = False,
    ) -> None:
        self._key: _Layout | None = None
        self._buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._pinned = False
        self._held = threading.Lock()  # taken, not yet released (by the writer thread)
        self._swap = threading.Lock()  # a prepare job installs its buffers under this
        self._model, self._optimizer = model, optimizer
        self._copier = SideStreamCopy(stage_on_device=stage_on_device)
        self._guard: RemovableHandle | None = None  # the optimizer's pre-step hook
        #: The way the last :meth:`take` copied (None before the first).
        self.path: CopyPath | None = None

    def take(self, tree: Any) -> Any:
        """Return a copy of ``tree`` whose tensors live in this snapshot's buffers.

        The result stays valid until :meth:`release`; the snapshot is held until then.
        On the side-stream path its values are there only once :meth:`wait` returned.

        Raises:
            CheckpointStateError: when a leaf is of a type a checkpoint cannot hold.
            RuntimeError: when the previous snapshot is still held (a save in flight).
        """
        tensors: list[torch.Tensor] = []
        skeleton = _flatten(tree, tensors, "state")
        if not self._held.acquire(blocking=False):
            raise RuntimeError(
                "the snapshot buffers still hold a save in flight: wait for it before the next"
            )
        try:
            with self._swap:
                views = self._copy(tensors)
        except BaseException:
            self._held.release()
            raise
        return _unflatten(skeleton, views)

    def prepare(self, tree: Any) -> Callable[[], None] | None:
        """A job that allocates and faults in the buffers a :meth:`take` of ``tree`` will need.

        Only the dtypes and sizes of the tree's tensors are read, here, on the
        calling thread. Run the job in any thread, at any time: it builds its
        buffers apart and installs them only if the snapshot is not held and has
        no buffers of that layout yet (a take that came first keeps its own). The
        first take of a tree of that layout then only copies.

        Returns:
            The job, or None when there is nothing to prepare: the buffers already
            fit, or the state is on a device other than the CPU without CUDA.

        Raises:
            CheckpointStateError: when a leaf is of a type a checkpoint cannot hold.
        """
        tensors: list[torch.Tensor] = []
        _flatten(tree, tensors, "state")
        key = _layout(tensors)
        on_device = any(t.device.type != "cpu" for t in tensors)
        pin = _pin(on_device)
        if (key, pin) == (self._key, self._pinned) or on_device != pin:
            return None

        def job() -> None:
            # Pinned pages are resident from the start (cudaHostAlloc); the others
            # are faulted in here rather than in the first take (ctypes releases
            # the GIL, so training threads keep running meanwhile).
            buffers, views = _build(key, pin=pin)
            for buffer in buffers:
                if buffer.numel() and not pin:
                    ctypes.memset(buffer.data_ptr(), 0, buffer.numel() * buffer.element_size())
            with self._swap:
                if (self._key, self._pinned) != (key, pin) and not self._held.locked():
                    self._key, self._buffers, self._views, self._pinned = key, buffers, views, pin
                    log.debug("snapshot buffers prepared: %d bytes", self.nbytes)

        return job

    def wait(self) -> None:
        """Block until the taken snapshot's values are all in the buffers.

        Only the side-stream path leaves copies in flight after :meth:`take`;
        safe to call from another thread than the one that took the snapshot.
        """
        self._copier.wait()

    def release(self) -> None:
        """Let the next :meth:`take` reuse the buffers (the save that read them is done)."""
        self._copier.wait()  # no copy may still be landing in them
        if self._held.locked():
            self._held.release()

    def close(self) -> None:
        """No more takes: wait for a copy in flight and remove the optimizer's hook."""
        self._copier.wait()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    @property
    def held(self) -> bool:
        """Whether a taken snapshot has not been released yet."""
        return self._held.locked()

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        key = _layout(tensors)
        path = copy_path(
            (t.device for t in tensors),
            guarded=self._optimizer is not None,
            cuda_available=torch.cuda.is_available(),
        )
        pin = _pin(path is not CopyPath.HOST)
        if key != self._key or pin != self._pinned:
            self._key, self._buffers, self._views = None, [], []  # free the old ones first
            self._buffers, self._views = _build(key, pin=pin)
            self._key, self._pinned = key, pin
            log.debug("snapshot buffers: %d bytes", self.nbytes)
        # Shape the destination like the source (never reshape the source: for a
        # non-contiguous tensor that would be one more full copy).
        views = [v.view(t.shape) for v, t in zip(self._views, tensors, strict=True)]
        self.path = path
        if path is CopyPath.SIDE_STREAM:
            assert self._optimizer is not None  # copy_path: only when guarded
            if self._guard is None:
                self._guard = self._copier.guard(self._optimizer)
            stable = stable_tensors(self._model, self._optimizer)
            self._copier.start(tensors, views, stable=stable)
            return views
        with torch.no_grad():
            for view, source in zip(views, tensors, strict=True):
                view.copy_(source, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        return views


def _pin(on_device: bool) -> bool:
    """Whether the host buffers of a state are pinned: it is on a device, and CUDA is there."""
    return on_device and torch.cuda.is_available()


def _build(key: _Layout, *, pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One buffer per dtype, and a flat view into it for each tensor of the layout."""
    totals: dict[torch.dtype, int] = {}
    for dtype, numel in key:
        totals[dtype] = totals.get(dtype, 0) + numel
    buffers = {d: torch.empty(n, dtype=d, pin_memory=pin) for d, n in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    views = []
    for dtype, numel in key:
        start = offsets[dtype]
        offsets[dtype] = start + numel
        views.append(buffers[dtype][start : start + numel])
    return list(buffers.values()), views


def run_in_background(job: Callable[[], None], *, name: str, nice: int = 0) -> threading.Thread:
    """Run a job nobody waits for in a daemon thread (niceness ``nice``); log its failure.

    For short work that only saves time later (preparing buffers). A daemon
    thread does not hold up the interpreter's exit.

    Returns:
        The thread, started.
    """

    def run() -> None:
        _lower_priority(nice, name)
        try:
            job()
        except Exception as exc:
            log.warning("%s failed (nothing lost; it only saves time later): %s", name, exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _lower_priority(nice: int, name: str) -> None:
    if nice and sys.platform.startswith("linux"):
        try:
            # Linux keeps a niceness per thread; this lowers only the calling thread's.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as exc:
            log.debug("could not lower the priority of %s: %s", name, exc)


def _flatten(node: Any, tensors: list[torch.Tensor], where: str) -> Any:
    if isinstance(node, torch.Tensor):
        if type(node) is not torch.Tensor and not isinstance(node, torch.nn.Parameter):
            raise CheckpointStateError(
                f"{where} is a {type(node).__name__}; sharded tensors need sharded=True"
            )
        if node.is_sparse or node.is_quantized or node.is_meta:
            raise CheckpointStateError(f"{where} is a sparse, quantized or meta tensor")
        tensors.append(node.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(node, dict):
        items = [(k, _flatten(v, tensors, f"{where}[{k!r}]")) for k, v in node.items()]
        return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
    if isinstance(node, list | tuple):
        items_ = [_flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(node)]
        return items_ if isinstance(node, list) else tuple(items_)
    if isinstance(node, _PLAIN):
        return node
    raise CheckpointStateError(
        f"{where} is a {type(node).__name__}; a checkpoint holds tensors, numbers, strings, "
        "bytes, None, lists, tuples and dicts"
    )


def _unflatten(node: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(node, _Slot):
        return views[node.index]
    if isinstance(node, dict):
        items = [(k, _unflatten(v, views)) for k, v in node.items()]
        return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
    if isinstance(node, list):
        return [_unflatten(v, views) for v in node]
    if isinstance(node, tuple):
        return tuple(_unflatten(v, views) for v in node)
    return node


class BackgroundWriter:
    """Runs one job at a time in a low-priority, non-daemon thread.

    A non-daemon thread means an interpreter that exits normally first finishes
    the save in flight. An error in the job is logged and kept in ``last_error``.

    Args:
        nice: niceness added to the writer thread (Linux); 0 leaves it alone.
    """

    def __init__(self, *, nice: int = WRITER_NICE) -> None:
        self._nice = nice
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """Whether a job is still running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None], *, name: str) -> None:
        """Start ``job`` in the background.

        Raises:
            RuntimeError: when a job is still running (wait for it first).
        """
        if self.busy:
            raise RuntimeError(f"cannot start {name}: the previous background save is running")
        self.last_error = None
        self._thread = threading.Thread(target=self._run, args=(job, name), name=name)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running job; return False if it is still running after ``timeout``."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self, job: Callable[[], None], name: str) -> None:
        _lower_priority(self._nice, name)
        started = time.monotonic()
        try:
            job()
        except BaseException as exc:
            self.last_error = exc
            log.error("%s failed after %.2f s: %s", name, time.monotonic() - started, exc)
