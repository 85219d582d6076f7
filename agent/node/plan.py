"""What the agent daemon does with its runners next: pure decisions, apart from the acts.

The daemon (:mod:`agent.node.daemon`) follows its node's assignments level-triggered:
each pass it reads what should run and what runs, decides, then acts. The
decisions are here, without etcd, processes or clocks, as the coordinator's are
in :func:`service.scheduler.plan`:

* :func:`choose_assignment`: which assignment a job runs here, given the one
  written at its key: a generation that started here already is kept (with
  new bounds taken over in place once confirmed, :mod:`agent.bounds`); a new
  one only once admitted (:mod:`agent.admission`); until then the runner
  goes on with what it runs.
* :func:`plan_runners`: given the runners running, the exited ones whose
  aftermath is not written yet, the generations that finished here and the
  chosen assignments, which runners to stop (and whether that is a restart
  counted as ``scaled``: a new generation of the job here), which take new
  bounds in place, and which to start. A runner that exited is the
  business of :mod:`agent.node.supervise` until its aftermath is written.

What a runner that exited leaves behind is decided by :func:`agent.node.supervise.after_exit`,
when to keep a warm runner by :mod:`agent.node.warm_policy`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import Enum

from agent.bounds import take_over
from rendezvous.records import Assignment


def choose_assignment(
    written: Assignment,
    *,
    runner: Assignment | None,
    exited: Assignment | None,
    finished_generation: int | None,
    admitted: Callable[[], bool],
) -> Assignment | None:
    """The assignment the job of ``written`` should run on this node.

    Args:
        written: the assignment at the job's key now.
        runner: what the job's live runner runs (stopping or not), if any.
        exited: what the job's exited runner ran, if its aftermath is pending.
        finished_generation: the job's generation that ended here last, if any.
        admitted: whether ``written`` may run (:class:`agent.admission.AssignmentGate`);
            asked only for a generation that has not started here, or for a
            rewrite in place of one that runs.

    Returns:
        ``written`` for a generation that finished here (it is not started
        again: :func:`plan_runners`) or that is new and admitted; the running
        generation, with ``written``'s bounds if it rewrites them in place and
        is confirmed; else what the runner runs (a change not admitted yet
        stops nothing), or None when there is none.
    """
    live = [a for a in (runner, exited) if a is not None]
    started = {a.generation for a in live}
    if finished_generation is not None:
        started.add(finished_generation)
    if written.generation in started:
        running = next((a for a in live if a.generation == written.generation), None)
        return written if running is None else take_over(running, written, admitted)
    if admitted():
        return written
    return runner


class StopReason(str, Enum):
    UNASSIGNED = "unassigned"  # its assignment is gone (cancelled, scaled down, drained)
    NEW_GENERATION = "new_generation"  # its job has a new generation here: a scaled restart


@dataclass(frozen=True)
class Stop:
    job_id: str
    reason: StopReason

    @property
    def scaled(self) -> bool:
        """Whether this counts as a restart of the job (reason ``scaled``): a new
        generation's runner replaces this one, and is wanted as soon as it is gone."""
        return self.reason == StopReason.NEW_GENERATION


@dataclass(frozen=True)
class RunnerView:
    """What :func:`plan_runners` knows of a live runner."""

    assignment: Assignment
    stopping: bool  # SIGTERM (or SIGKILL) was sent


@dataclass(frozen=True)
class RunnerPlan:
    """The changes one pass makes to the runners, in this order."""

    stop: tuple[Stop, ...] = ()  # runners to stop (each not stopping yet)
    rebound: tuple[Assignment, ...] = ()  # runners that go on with these bounds
    start: tuple[Assignment, ...] = ()  # assignments to start a runner for


def plan_runners(
    *,
    desired: Mapping[str, Assignment],
    runners: Mapping[str, RunnerView],
    exited: Collection[str],
    finished: Mapping[str, int],
) -> RunnerPlan:
    """What to do so that the runners match ``desired``.

    Args:
        desired: job -> the assignment it should run here (:func:`choose_assignment`).
        runners: job -> its live runner.
        exited: jobs whose runner exited and whose aftermath is not written yet
            (no runner is started for them: :mod:`agent.node.supervise` restarts it
            if the exit is charged).
        finished: job -> the generation that last ended here; never started again
            (the coordinator decides what comes next).

    Returns:
        The plan: a runner whose job is not desired, or desired at another
        generation, is stopped (once: one already stopping is left to end);
        one desired at its own generation with other bounds takes them over
        and goes on; a desired job with no runner, none exited, and not
        finished at that generation gets one. A job is never both stopped and
        started: its next generation starts once the stopped runner is gone.
    """
    stop: list[Stop] = []
    rebound: list[Assignment] = []
    for job_id, runner in runners.items():
        wanted = desired.get(job_id)
        if wanted is None or wanted.generation != runner.assignment.generation:
            if not runner.stopping:
                reason = StopReason.UNASSIGNED if wanted is None else StopReason.NEW_GENERATION
                stop.append(Stop(job_id, reason))
        elif wanted != runner.assignment:  # new bounds, in place: nothing restarts
            rebound.append(wanted)
    start = [
        assignment for job_id, assignment in desired.items()
        if job_id not in runners and job_id not in exited
        and finished.get(job_id) != assignment.generation
    ]
    return RunnerPlan(stop=tuple(stop), rebound=tuple(rebound), start=tuple(start))
