"""When the agent daemon keeps a warm runner, and when the next one starts: pure decisions.

A warm runner is a runner started ahead of the next job
(``python -m agent.runner --warm``; :class:`agent.node.launch.WarmRunner`
starts, hands over and discards it). It starts its zygote and imports torch
elastic at once, then waits on stdin. When a job is assigned, the daemon
writes the spec's path to it instead of starting a new process, and the
runner's log file is renamed into the job's directory. A new node therefore
joins a job as soon as its assignment arrives rather than after ``python`` +
``import torch`` (1.5 to 3 s), and a node that takes one job after another
starts each at once. While the node's slots are all in use it is the spare
that replaces a runner that dies (restarted on the job's budget): the job's
workers start again in about a second, as after a worker's death, rather
than after a cold runner's ``import torch``.

What is decided here, without processes or clocks of its own:

* :func:`wants_warm_runner`: whether one is wanted at all, given the node's
  slots and runners;
* :func:`warm_step`: what to do with the warm runner on a pass of the daemon:
  nothing, forget one that exited on its own, or start one;
* :class:`WarmTimer`: from when the next one may start. Not at once after one
  is taken (it would compete for the CPU with the job starting); after one
  died on its own, a delay that doubles up to five minutes (a runner that
  cannot start is not restarted in a tight loop); at once when a runner is
  stopped for its job's next generation here (its successor is wanted as soon
  as it is gone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from rendezvous.records import Assignment

#: Seconds after a warm runner is taken before the next one starts.
WARM_REFILL_DELAY_S = 10.0
#: Seconds before replacing a warm runner that died on its own (doubles up to WARM_RETRY_MAX_S).
WARM_RETRY_S = 30.0
WARM_RETRY_MAX_S = 300.0


def wants_warm_runner(slots: int, runners: Iterable[tuple[Assignment, bool]]) -> bool:
    """Whether the node should keep a warm runner ready, given its runners.

    ``runners``: each running runner's assignment, and whether it is being
    stopped. One is kept for the next job while a slot is free, a stopping
    runner's slots counting as free (its job's next generation will want a
    runner as soon as it has left). While the slots are all in use, one is
    kept as the spare that replaces a runner that dies (agent.node.supervise), as
    long as a runner's job has restarts to spend: a SIGKILLed runner is then
    replaced at once, not after ``python`` and ``import torch`` again.
    """
    running = [assignment for assignment, stopping in runners if not stopping]
    if slots - sum(a.nproc_per_node for a in running) >= 1:
        return True
    return any(a.max_restarts > 0 for a in running)


class WarmState(str, Enum):
    NONE = "none"  # there is no warm runner
    WAITING = "waiting"  # one is alive, waiting for a job
    EXITED = "exited"  # one exited on its own


class WarmStep(str, Enum):
    WAIT = "wait"  # nothing to do on this pass
    FORGET = "forget"  # drop the one that exited; the next may start after a delay
    SPAWN = "spawn"  # start one


@dataclass(frozen=True)
class WarmTimer:
    """From when the next warm runner may start.

    Attributes:
        due: monotonic seconds from which one may start.
        retry_s: the delay after the next one that dies on its own.
    """

    due: float = 0.0
    retry_s: float = WARM_RETRY_S

    def died(self, now: float) -> WarmTimer:
        """After a warm runner exited on its own: wait, and twice as long the next time."""
        return WarmTimer(now + self.retry_s, min(self.retry_s * 2, WARM_RETRY_MAX_S))

    def taken(self, now: float, *, handed: bool) -> WarmTimer:
        """After a job took the warm runner (``handed``) or found it gone: the next one
        starts a while later; a runner that took its job proves the next may retry soon."""
        return WarmTimer(now + WARM_REFILL_DELAY_S, WARM_RETRY_S if handed else self.retry_s)

    def successor_wanted(self) -> WarmTimer:
        """A runner is being stopped for its job's next generation here: the next warm
        runner may start at once, to be ready when that one is gone."""
        return dataclasses.replace(self, due=0.0)


def warm_step(
    state: WarmState, *, now: float, timer: WarmTimer, wanted: bool, stopping: bool
) -> WarmStep:
    """What to do with the warm runner on one pass of the daemon.

    Args:
        state: whether there is one, alive or exited.
        now: monotonic seconds.
        timer: from when the next one may start.
        wanted: :func:`wants_warm_runner` now.
        stopping: whether the daemon is stopping (it starts nothing more).

    Returns:
        FORGET for one that exited on its own (the daemon then starts the
        timer's retry delay: :meth:`WarmTimer.died`); SPAWN when there is none,
        one is wanted, it is time and the daemon is not stopping; else WAIT.
        One that waits for a job is kept even when none is wanted any more
        (it would only be started again).
    """
    if state == WarmState.EXITED:
        return WarmStep.FORGET
    if state == WarmState.WAITING or stopping or now < timer.due or not wanted:
        return WarmStep.WAIT
    return WarmStep.SPAWN
