"""Asynchronous saving: snapshot the state off the device, write it in the background.

The training loop is blocked only while :class:`StateSnapshot` copies every
tensor of the state into buffers it allocated on the first save and reuses on
every later one (pinned host memory when the state lives on a GPU). Allocating
fresh buffers each time costs more than the copy itself on CPU (page faults on
hundreds of MB), which is why they are kept.

:class:`BackgroundWriter` then runs serialization, checksumming and disk writes
in one thread whose scheduling priority is lowered (Linux priorities are per
thread), so that on a machine with few cores the writer takes the CPU time the
training threads leave idle rather than slowing every step. Its heavy work
(``torch.save`` of large storages, CRC-32, ``write``) runs with the GIL
released.

Only one save is in flight at a time: the snapshot buffers are reused, so a new
snapshot must wait until the writer is done with the previous one. The
checkpointer decides whether to wait or to skip (see docs/checkpoints.md).
"""

from __future__ import annotations

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

from checkpoints.errors import CheckpointStateError

__all__ = ["WRITER_NICE", "BackgroundWriter", "StateSnapshot"]

log = logging.getLogger(__name__)

#: Niceness of the writer thread (0 = as urgent as training, 19 = only idle CPU).
WRITER_NICE = 19

_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.Size)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the state tree: its index among the tensors."""

    index: int


class StateSnapshot:
    """Copies the tensors of a state tree into reusable host buffers, one per dtype.

    The tree may nest dicts (any keys), lists and tuples of tensors and plain
    values (numbers, strings, bytes, None, dtypes). Its tensors come back as views
    into one buffer per dtype, so ``torch.save`` writes each dtype as one record.
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[torch.dtype, int], ...] | None = None
        self._views: list[torch.Tensor] = []
        self._pinned = False

    def take(self, tree: Any) -> Any:
        """Return a copy of ``tree`` whose tensors live in this snapshot's buffers.

        The result stays valid until the next call.

        Raises:
            CheckpointStateError: when a leaf is of a type a checkpoint cannot hold.
        """
        tensors: list[torch.Tensor] = []
        skeleton = _flatten(tree, tensors, "state")
        key = tuple((t.dtype, t.numel()) for t in tensors)
        on_device = any(t.device.type != "cpu" for t in tensors)
        if key != self._key or (on_device and not self._pinned):
            self._allocate(tensors, pin=on_device and torch.cuda.is_available())
            self._key = key
        with torch.no_grad():
            for view, source in zip(self._views, tensors, strict=True):
                view.copy_(source.reshape(view.shape), non_blocking=self._pinned)
        if on_device and torch.cuda.is_available():
            torch.cuda.synchronize()
        views = [v.view(t.shape) for v, t in zip(self._views, tensors, strict=True)]
        return _unflatten(skeleton, views)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(v.numel() * v.element_size() for v in self._views)

    def _allocate(self, tensors: list[torch.Tensor], *, pin: bool) -> None:
        totals: dict[torch.dtype, int] = {}
        for t in tensors:
            totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
        buffers = {d: torch.empty(n, dtype=d, pin_memory=pin) for d, n in totals.items()}
        offsets = dict.fromkeys(totals, 0)
        self._views = []
        for t in tensors:
            start = offsets[t.dtype]
            offsets[t.dtype] = start + t.numel()
            self._views.append(buffers[t.dtype][start : start + t.numel()].view(-1))
        self._pinned = pin
        log.debug("snapshot buffers: %d bytes in %d dtypes", self.nbytes, len(buffers))


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
        if self._nice and sys.platform.startswith("linux"):
            try:
                # Linux keeps a niceness per thread; this lowers only the writer's.
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError as exc:
                log.debug("could not lower the priority of %s: %s", name, exc)
        started = time.monotonic()
        try:
            job()
        except BaseException as exc:
            self.last_error = exc
            log.error("%s failed after %.2f s: %s", name, time.monotonic() - started, exc)
