"""What the agent does when a job's runner has exited: a pure decision.

A runner reports how its job ended on this node itself (status SUCCEEDED,
FAILED or CANCELLED in etcd, then exit code 0, 1 or 3). When it could not,
because it was SIGKILLed, crashed, ran out of memory or lost etcd at the
wrong moment, the job would otherwise show RUNNING for ever with no worker
on this node. :func:`after_exit` decides, from what the daemon knows once the
process is gone, what to write in its place:

* the daemon stopped it (assignment removed or changed): nothing; the
  coordinator has moved on;
* it reported a terminal state for this generation: nothing;
* it exited 0, 1 or 3 but the final write was lost: that state, written for it;
* anything else is a crash of the node's runner. Like a worker failure it is
  charged to the job's restart budget on this node (``worker_failed``, the
  budget torch elastic charges for worker failures): with budget left the
  daemon writes RESTARTING with the cause and starts a new runner that goes on
  from that record; with none left it writes FAILED with the cause, and the
  coordinator fails the job.

The root cause in either case names the runner, its exit code or signal, and
the runner's own account (its outcome file) or the tail of its log.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

from agent.spec import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED, RunnerOutcome
from rendezvous.records import (
    RUNNER_RANK,
    Assignment,
    JobNodeState,
    JobNodeStatus,
    RestartReason,
    WorkerError,
)


class Action(str, Enum):
    NOTHING = "nothing"  # leave the status as it is
    REPORT = "report"  # write ``status``; the generation is over on this node
    RESTART = "restart"  # write ``status``, then start a runner that goes on from it


@dataclass(frozen=True)
class Aftermath:
    action: Action
    status: JobNodeStatus | None = None  # what to write (REPORT, RESTART)


def signal_name(code: int) -> str | None:
    """``SIGKILL`` for an exit code of -9, None for a code that is not a signal."""
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(pid: int, code: int) -> str:
    """"the runner (pid 12) was killed by SIGKILL" or "... exited with code 4"."""
    name = signal_name(code)
    how = f"was killed by {name}" if name else f"exited with code {code}"
    return f"the runner (pid {pid}) {how}"


def runner_error(
    *, pid: int, code: int, outcome: RunnerOutcome | None, log_tail: str
) -> WorkerError:
    """The root cause of a runner's end, for the job's status.

    A job that cannot start here (exit code 1 with an outcome: a missing
    working directory) has the reason alone as its message.
    """
    if outcome is not None and code == EXIT_FAILED:
        message = outcome.message
    elif outcome is not None:
        message = f"{describe_exit(pid, code)}: {outcome.message}"
    else:
        message = f"{describe_exit(pid, code)} without reporting how its job ended"
    return WorkerError(
        rank=RUNNER_RANK,
        exit_code=code,
        signal=signal_name(code),
        message=message[-4000:],
        traceback=((outcome.traceback if outcome is not None else "") or log_tail)[-60000:],
    )


def after_exit(
    *,
    assignment: Assignment,
    node_id: str,
    pid: int,
    code: int,
    stopping: bool,
    reported: JobNodeStatus | None,
    outcome: RunnerOutcome | None = None,
    log_tail: str = "",
) -> Aftermath:
    """What to do now that the runner ``pid`` of ``assignment`` exited with ``code``.

    Args:
        assignment: what the runner ran.
        node_id: this node.
        pid / code: the runner's process id and exit code (negative: a signal).
        stopping: the daemon had asked it to stop.
        reported: its status record in etcd now (any generation), if there is one.
        outcome: its outcome file, if it wrote one.
        log_tail: the end of its log, the root cause's text when there is no outcome.

    Returns:
        The action and the status to write for it.
    """
    if stopping:
        return Aftermath(Action.NOTHING)
    if reported is not None and reported.generation != assignment.generation:
        reported = None
    if reported is not None and reported.state.is_terminal():
        return Aftermath(Action.NOTHING)
    base = reported or JobNodeStatus(
        job_id=assignment.job_id,
        node_id=node_id,
        generation=assignment.generation,
        state=JobNodeState.STARTING,
        remaining_restarts=assignment.max_restarts,
    )
    base = base.model_copy(update={"world_size": 0, "ranks": [], "pid": 0})
    finished = {EXIT_SUCCEEDED: JobNodeState.SUCCEEDED, EXIT_FAILED: JobNodeState.FAILED,
                EXIT_STOPPED: JobNodeState.CANCELLED}
    if code in finished:  # it ended on purpose; only its last write was lost
        update: dict[str, object] = {"state": finished[code]}
        if code == EXIT_FAILED and base.error is None:
            update["error"] = runner_error(pid=pid, code=code, outcome=outcome,
                                           log_tail=log_tail)
        return Aftermath(Action.REPORT, base.model_copy(update=update))
    reasons = dict(base.restart_reasons)
    reason = RestartReason.WORKER_FAILED
    reasons[reason.value] = reasons.get(reason.value, 0) + 1
    budget = base.remaining_restarts
    status = base.model_copy(update={
        "error": runner_error(pid=pid, code=code, outcome=outcome, log_tail=log_tail),
        "restart_count": base.restart_count + 1,
        "restart_reasons": reasons,
        "last_restart_reason": reason,
        "remaining_restarts": max(0, budget - 1),
        "state": JobNodeState.RESTARTING if budget > 0 else JobNodeState.FAILED,
    })
    return Aftermath(Action.RESTART if budget > 0 else Action.REPORT, status)
