"""A rank's own pace: the seconds it spends computing a step, not waiting for the others.

In data-parallel training every rank waits for the slowest at the gradient
all-reduce, so a step's wall time is the same on every rank and says nothing
about which one is slow. What differs is when each rank's *own* work is done:
its forward and backward, up to the moment its last gradient is ready. From then
on a fast rank only waits (DDP's reducer blocks at the end of the backward until
every bucket's all-reduce has finished).

:class:`PaceMeter` takes two timestamps a step, from hooks that need no help
from the training script:

* the first forward of the step (a forward pre-hook on the model);
* the last gradient accumulated (a post-accumulate-grad hook on every
  parameter that requires one): this rank's backward is done.

Their difference is the rank's pace for the step; gradient accumulation (several
forwards before an optimizer step) counts whole. Each hook costs one clock read;
the steps' paces are kept for the last :data:`KEEP_STEPS` steps and go out with the
progress report (:class:`checkpoints.protocol.progress.ProgressReport`'s ``paces``),
where the runner takes each node's slowest rank and the coordinator compares the
nodes (:mod:`service.scheduler.stragglers`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["KEEP_STEPS", "PaceMeter"]

#: How many recent steps' paces a rank keeps (and reports).
KEEP_STEPS = 64


class PaceMeter:
    """Times a rank's own work each step through hooks on ``model``.

    Args:
        model: the module trained (the one DDP wraps, or the wrapper: the
            parameters are the same).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, model: torch.nn.Module, *, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start: float | None = None
        self._done: float | None = None
        self._paces: collections.deque[tuple[int, float]] = collections.deque(maxlen=KEEP_STEPS)
        self._handles: list[Any] = [model.register_forward_pre_hook(self._forward)]
        for param in model.parameters():
            if param.requires_grad:
                hook = param.register_post_accumulate_grad_hook  # untyped in torch
                self._handles.append(hook(self._grad))  # type: ignore[no-untyped-call]

    def _forward(self, *_: Any) -> None:
        if self._start is None:
            self._start = self._clock()

    def _grad(self, _: torch.Tensor) -> None:
        self._done = self._clock()

    def boundary(self, step: int) -> float | None:
        """Close ``step`` (called after its optimizer step): its pace, or None if it had no
        forward and backward to time."""
        start, done = self._start, self._done
        self._start = self._done = None
        if start is None or done is None or done < start:
            return None
        pace = done - start
        self._paces.append((step, pace))
        return pace

    def discard(self) -> None:
        """Forget the step in flight (it failed, or the group was re-formed)."""
        self._start = self._done = None

    def recent(self) -> list[tuple[int, float]]:
        """The last :data:`KEEP_STEPS` steps' ``(step, pace in seconds)``, oldest first."""
        return list(self._paces)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
