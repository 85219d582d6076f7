"""What a framework's callback does at each step boundary: progress, pace, an agreed stop.

A training framework calls its callbacks at the same points of every step on
every rank. :class:`StepBoundary` is the framework-neutral part of tidal's
callbacks (:mod:`checkpoints.frameworks.hf`, :mod:`checkpoints.frameworks.lightning`):

* progress (step, loss, total steps, samples) through
  :func:`checkpoints.progress.create_progress_reporter`, a no-op outside tidal;
* the rank's pace (:class:`checkpoints.pace.PaceMeter` on the model);
* SIGTERM turned into a flag (:class:`checkpoints.signals.StopSignal`) and the
  flag agreed across ranks with an all-reduce(MAX) on a private gloo group, one
  step late (:class:`checkpoints.signals.StepConsensus`), so every rank stops at
  the same step, the way the Checkpointer's ``maybe_save`` does.

The callback turns an agreed stop into the framework's own checkpoint and, once
every rank's part of it is written (:meth:`StepBoundary.finish_stop`'s barrier),
exits with :data:`checkpoints.signals.EXIT_PREEMPTED`.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.pace import PaceMeter
from checkpoints.progress import ProgressReporter, create_progress_reporter
from checkpoints.signals import StepConsensus, StopSignal

__all__ = ["StepBoundary"]

log = logging.getLogger(__name__)

# As the Checkpointer's private groups: long enough for a slow rank's save.
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


class StepBoundary:
    """Progress, pace and the agreed stop of one training run, driven by a framework's hooks.

    Every rank calls :meth:`begin` once, :meth:`step_end` after every optimizer
    step (the same number of times on every rank) and :meth:`end` once.

    Args:
        progress: where progress goes (default: :func:`create_progress_reporter`,
            made at :meth:`begin`, once the rank is known).
        handle_sigterm: turn SIGTERM into an agreed stop (needs the main thread).
        sigterm_grace_seconds: after SIGTERM, exit at once if still running this long.
    """

    def __init__(
        self,
        *,
        progress: ProgressReporter | None = None,
        handle_sigterm: bool = True,
        sigterm_grace_seconds: float = 60.0,
    ) -> None:
        self._given_progress = progress
        self.progress: ProgressReporter | None = progress
        self._handle_sigterm = handle_sigterm
        self.signal = StopSignal(grace_seconds=sigterm_grace_seconds)
        self._group: dist.ProcessGroup | None = None
        self._consensus: StepConsensus | None = None
        self._pace: PaceMeter | None = None
        self._samples: int | None = None
        self._loss: Any = None
        self._step_ended = time.monotonic()
        #: The step every rank agreed to stop at (None: no stop agreed).
        self.stop_step: int | None = None

    @property
    def rank(self) -> int:
        """This process's global rank (0 without torch.distributed)."""
        return dist.get_rank() if _distributed() else 0

    def begin(
        self,
        model: torch.nn.Module | None,
        *,
        total_steps: int | None = None,
        samples_per_step: int | None = None,
    ) -> None:
        """Training starts: report to the agent, time ``model``'s steps, handle SIGTERM.

        Collective when torch.distributed is initialized with more than one rank
        (it makes the private gloo group).
        """
        if self.progress is None:
            self.progress = create_progress_reporter(rank=self.rank)
        if total_steps is not None and total_steps > 0:
            self.progress.set_total_steps(total_steps)
        self._samples = samples_per_step
        if model is not None and self._pace is None:
            self._pace = PaceMeter(model)
            self.progress.set_pace_source(self._pace.recent)
        if _distributed() and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
            self._consensus = StepConsensus(self._group, width=1)
        if self._handle_sigterm:
            self.signal.install()
        self.stop_step = None
        self._step_ended = time.monotonic()

    def install_signal(self) -> None:
        """Handle SIGTERM from now on (again): for a framework that installs its own later."""
        if self._handle_sigterm:
            self.signal.uninstall()
            self.signal.install()

    def note_loss(self, loss: Any) -> None:
        """Remember the latest loss (a tensor is read only when the report is written)."""
        if loss is not None:
            self._loss = loss

    def step_end(self, step: int, *, loss: Any = None) -> bool:
        """``step`` optimizer steps are complete: report, time, and agree on a stop.

        Returns:
            Whether every rank agreed to stop at this step (the same answer on
            every rank). Once it is True, :attr:`stop_step` is ``step``.
        """
        self.note_loss(loss)
        if self._pace is not None:
            self._pace.boundary(step)
        if self.progress is not None:
            self.progress.record(step=step, loss=self._loss, samples=self._samples)
        if self.stop_step is not None:
            return False  # already stopping: no more exchanges
        requested = self.signal.requested
        if self._consensus is not None:
            requested = bool(self._consensus.exchange([int(requested)])[0])
        self._step_ended = time.monotonic()
        if requested:
            self.stop_step = step
            log.warning("stop requested: every rank stops at step %d with a checkpoint", step)
            if self.progress is not None:
                self.progress.stop_requested()
        return requested

    def saved(self, step: int) -> None:
        """The framework committed its checkpoint of ``step`` (report it to the agent).

        The durations are measured from the end of the step, so they include
        whatever the framework did in between (logging, evaluation).
        """
        if self.progress is not None:
            took = time.monotonic() - self._step_ended
            self.progress.checkpoint_saved(
                step=step, wall_time=time.time(), save_seconds=took, stall_seconds=took
            )

    def finish_stop(self) -> None:
        """Wait until every rank has written its part of the stop's checkpoint.

        Collective: every rank calls it after its save.
        """
        if self._consensus is not None:
            self._consensus.drain()
        if self._group is not None:
            dist.barrier(group=self._group)
        if self.progress is not None:
            self.progress.flush()

    def end(self) -> None:
        """Training ended: drain the reduction in flight and destroy the private group, stop
        handling SIGTERM, report.

        Collective when there is a private group (every rank's training ends together).
        """
        consensus, self._consensus, self._group = self._consensus, None, None
        if consensus is not None:  # drains first (StepConsensus.destroy)
            consensus.destroy()
        self.signal.uninstall()
        if self._pace is not None:
            self._pace.close()
            self._pace = None
        if self.progress is not None:
            self.progress.flush()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
