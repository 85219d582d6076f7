"""Graceful stop: SIGTERM becomes a checkpoint at the next step boundary and exit code 75.

The node agent sends SIGTERM when it drains or rescales a node. The handler
only sets a flag; the checkpointer notices it at the next ``maybe_save``, saves
(synchronously, flushed), and raises ``SystemExit(EXIT_PREEMPTED)``. A second
SIGTERM, or ``grace_seconds`` passing without the process exiting, ends the
process at once with the default action of the signal (status "killed by
SIGTERM"), so a stuck save never holds a node hostage.

In a distributed job the ranks must stop at the *same* step: in a sharded save
every rank takes part, and in a replicated one a rank that runs one step
further than rank 0 hangs in its all-reduce. :class:`StepConsensus` agrees on
per-step flags with an all-reduce(MAX) on a private gloo group, one step late:
the reduction launched at step ``s`` runs in the background while step ``s+1``
computes, and is read at the end of step ``s+1``. Every rank reads the same
result at the same step, so they agree without waiting for each other beyond
what DDP already does.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.live.group import group_timeout

__all__ = ["EXIT_PREEMPTED", "StepConsensus", "StopSignal"]

log = logging.getLogger(__name__)

#: Exit code after a requested stop with a checkpoint written (EX_TEMPFAIL): "restart me".
EXIT_PREEMPTED = 75


class StopSignal:
    """Turns SIGTERM into a stop request honoured at the next step boundary.

    Args:
        grace_seconds: after the first signal, exit at once if still running this long.
        signum: the signal to handle.
    """

    def __init__(self, *, grace_seconds: float = 60.0, signum: int = signal.SIGTERM) -> None:
        self._grace = grace_seconds
        self._signum = signum
        self._previous: Any = None
        self._installed = False
        self._requested_at: float | None = None
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        """Whether a stop was requested."""
        return self._requested_at is not None

    def install(self) -> bool:
        """Handle the signal from now on; False (and a log line) outside the main thread."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning("not handling signal %d: the checkpointer was not made in the main thread",
                        self._signum)
            return False
        self._previous = signal.signal(self._signum, self._handle)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Put the previous handler back and cancel the grace timer."""
        if self._installed:
            signal.signal(self._signum, self._previous)
            self._installed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def request(self) -> None:
        """Ask for a stop as if the signal had arrived (first time only starts the timer)."""
        if self._requested_at is not None:
            return
        self._requested_at = time.monotonic()
        if self._grace > 0:
            self._timer = threading.Timer(self._grace, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No logging here: the handler may interrupt a logging call in this thread.
        if self._requested_at is not None:
            self._die()
        self.request()

    def _expire(self) -> None:
        log.error("still running %.0f s after the stop request; exiting now", self._grace)
        self._die()

    def _die(self) -> None:
        signal.signal(self._signum, signal.SIG_DFL)
        os.kill(os.getpid(), self._signum)


class StepConsensus:
    """Agrees on integer flags across ranks, one step late (all-reduce MAX, in the background).

    Every rank must call :meth:`exchange` the same number of times, and
    :meth:`drain` (or :meth:`destroy`) before it leaves the group.

    Each reduction fails within the default (training) group's timeout, not the private group's
    (the checkpointer's is 10 minutes, for restores and saves): gloo can leave
    a send of a reduction posted just before its peers died waiting for the
    op's whole timeout although both peers' connections are closed (seen as
    "Timed out waiting 60000ms for send operation to complete" on a rank whose
    two peers were dead), in :meth:`drain` and again in the group's destructor
    at interpreter exit.

    The flags travel in one tensor that this object holds for its whole life. A
    gloo worker thread can hold an operation a little after it completed (a
    barrier holds the reductions posted before it); if Python had dropped the
    operation's tensor by then, releasing it takes the GIL, and at interpreter
    exit that aborts the process ("terminate called without an active
    exception", SIGABRT: a rank stopped on SIGTERM exited -6 instead of 75).
    Its owners call :meth:`destroy` when done (``Checkpointer.close``,
    ``StepBoundary.end``), so that no thread of the group is left for the exit.

    Args:
        group: a gloo process group used for nothing else; :meth:`destroy` destroys it.
        width: how many flags are exchanged.
    """

    def __init__(self, group: dist.ProcessGroup, *, width: int) -> None:
        self._group: dist.ProcessGroup | None = group
        self._width = width
        # The default group's timeout, the training script's choice (60 s when unreadable).
        self._timeout = group_timeout()
        self._flags = torch.zeros(width, dtype=torch.int64)
        self._pending: Any = None  # the reduction in flight (a c10d Work)

    def exchange(self, flags: list[int]) -> list[int]:
        """Send this step's flags; return the MAX over ranks of the previous call's flags.

        The first call returns zeros.
        """
        if len(flags) != self._width:
            raise ValueError(f"expected {self._width} flags, got {len(flags)}")
        if self._group is None:
            raise RuntimeError("the step consensus was destroyed")
        agreed = self.drain()
        self._flags.copy_(torch.tensor(flags, dtype=torch.int64))
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        options.timeout = self._timeout
        self._pending = self._group.allreduce([self._flags], options)
        return agreed

    def drain(self) -> list[int]:
        """Wait for the reduction in flight; return its result (zeros if none)."""
        if self._pending is None:
            return [0] * self._width
        work, self._pending = self._pending, None
        work.wait()
        return [int(v) for v in self._flags.tolist()]

    def destroy(self) -> None:
        """Drain, then destroy the group and join its threads now, while the interpreter is whole.

        The caller must hold no other reference to the group: the last one goes
        here, and with it the group's threads (they hold no tensor Python dropped).
        """
        self.drain()
        group, self._group = self._group, None
        if group is None:
            return
        dist.destroy_process_group(group)
        del group  # the last reference: ProcessGroupGloo's destructor joins its threads
