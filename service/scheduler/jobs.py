"""Each job's own steps in a pass, before and after the rounds place anything:

* fold the agents' reports into the record: charged restarts and resize paths,
  each rise one event (:func:`count_charges`, :func:`count_resizes`, over
  :mod:`service.scheduler.reports`);
* end a job that was cancelled, succeeded or failed (:func:`finish_if_done`,
  its message by :func:`failure_message`);
* keep the assignments on nodes that are usable, dropping the lost, the
  drained and those whose runner left (:func:`keep_usable`);
* apply the user's new bounds: release the surplus, rewrite the rest in place
  (:func:`rebound`), and say so once placed (:func:`note_rebound`).

The events of placement and the phase and conditions a job ends the pass in
are :mod:`service.scheduler.phases`'s.
"""

from __future__ import annotations

from rendezvous.records import RUNNER_RANK, Assignment, JobNodeState, JobNodeStatus
from service.api.models import EventReason, ExitReason, JobPhase, JobRecord
from service.scheduler.reports import (
    CHARGED_REASON,
    current_statuses,
    resize_rises,
    restart_charges,
)
from service.scheduler.state import SchedulerPass
from service.scheduler.types import clip, names, with_bounds


def failure_message(status: JobNodeStatus) -> str:
    """The event of a job that failed because of ``status``'s node.

    A runner's failure (it could not start the job, raised or was killed) is
    quoted as its message: it names the cause, which an exit code would not.
    """
    error = status.error
    if error is not None and error.rank == RUNNER_RANK and error.message:
        return f"the job failed on {status.node_id}: {clip(error.message)}"
    detail = f": exit code {error.exit_code}" if error is not None else ""
    return f"a worker failed on {status.node_id} and the restart budget is spent{detail}"


def count_charges(p: SchedulerPass, record: JobRecord, assigned: dict[str, Assignment]) -> None:
    """Add the restarts the agents charged since the last pass to the job's
    ``restarts``, with one ``restart_charged`` event per node whose count rose."""
    job_id = record.job_id
    generations = {n: a.generation for n, a in assigned.items()}
    folded, rises = restart_charges(
        record.charged, generations, p.view.statuses.get(job_id, {})
    )
    if folded == record.charged:
        return
    change = p.change(job_id)
    change.record.charged = folded
    restarts = change.record.restarts
    for charge in rises:
        restarts[CHARGED_REASON] = (
            restarts.get(CHARGED_REASON, 0) + charge.count - charge.before
        )
        if charge.restarts <= 0:
            continue  # the node's budget is spent: the job's end says why
        st = charge.status
        error = st.error
        who = "the runner" if error is not None and error.rank == RUNNER_RANK else "a worker"
        message = (f"{who} failed on {charge.node_id}; restart {charge.count} charged to "
                   f"its budget ({st.remaining_restarts} left)")
        if error is not None and error.message:
            message += f": {clip(error.message)}"
        p.event(job_id, EventReason.RESTART_CHARGED, message, [charge.node_id],
                members=len(assigned))  # before this pass decides who stays


def count_resizes(p: SchedulerPass, record: JobRecord, assigned: dict[str, Assignment]) -> None:
    """One event per path the nodes' membership changes took since the last pass."""
    job_id = record.job_id
    generations = {n: a.generation for n, a in assigned.items()}
    folded, rises = resize_rises(
        record.resized, generations, p.view.statuses.get(job_id, {})
    )
    if folded == record.resized:
        return
    p.change(job_id).record.resized = folded
    for path, reports in sorted(rises.items()):
        nodes = [st.node_id for st in reports]
        if path == "live":
            reason, message = EventReason.RESIZED_LIVE, f"resized live on {names(nodes)}"
        else:
            # last_resize is "restart (<cause>)" when a live resize fell back
            causes = sorted({c for st in reports
                             if (c := (st.last_resize or "").partition("(")[2].rstrip(")"))})
            reason = EventReason.RESIZED_BY_RESTART
            message = f"resized by a restart on {names(nodes)}"
            if causes:
                message += f": {clip('; '.join(causes))}"
        p.event(job_id, reason, message, nodes, members=len(assigned))


def finish_if_done(
    p: SchedulerPass, record: JobRecord, assigned: dict[str, Assignment]
) -> bool:
    """End the job if it was cancelled, succeeded or failed; whether it ended."""
    job_id = record.job_id
    reports = current_statuses(assigned, p.view.statuses.get(job_id, {}))
    if record.cancel_requested:
        outcome = (JobPhase.CANCELLED, ExitReason.CANCELLED, EventReason.CANCELLED,
                   "cancelled by the user")
    elif any(st.state == JobNodeState.SUCCEEDED for st in reports.values()):
        outcome = (JobPhase.SUCCEEDED, ExitReason.SUCCEEDED, EventReason.SUCCEEDED,
                   "the workers finished")
    else:
        failed = [st for st in reports.values() if st.state == JobNodeState.FAILED]
        if not failed:
            return False
        first = min(failed, key=lambda st: st.updated_at)
        p.change(job_id).record.error = first.error
        outcome = (JobPhase.FAILED, ExitReason.WORKER_FAILED, EventReason.WORKER_FAILED,
                   failure_message(first))
    phase, exit_reason, reason, message = outcome
    change = p.change(job_id)
    change.record.exit_reason = exit_reason
    change.record.set_condition("Finished", True, reason.value, message, now=p.now)
    change.record.set_condition("Running", False, reason.value, message, now=p.now)
    change.record.set_condition("Training", False, reason.value, message, now=p.now)
    p.members[job_id] = {}
    change.record.nodes = {}
    p.set_phase(job_id, phase, reason, message)
    change.delete.extend(sorted(assigned))
    return True


def keep_usable(p: SchedulerPass, record: JobRecord, assigned: dict[str, Assignment]) -> None:
    """Drop assignments on nodes that are gone, draining, or that left the job."""
    job_id = record.job_id
    view = p.view
    reports = current_statuses(assigned, view.statuses.get(job_id, {}))
    kept: dict[str, Assignment] = {}
    lost: list[str] = []
    drained: list[str] = []
    for node_id, assignment in sorted(assigned.items()):
        left = node_id in reports and reports[node_id].state == JobNodeState.CANCELLED
        if node_id not in view.nodes or left:
            lost.append(node_id)
            if left:
                p.left.setdefault(job_id, set()).add(node_id)
        elif node_id in view.draining:
            drained.append(node_id)
        else:
            kept[node_id] = assignment
            p.adjust(node_id, -assignment.nproc_per_node)
    p.members[job_id] = kept
    change = p.change(job_id) if (lost or drained) else None
    if change is not None:
        change.delete.extend(lost + drained)
    if lost:
        p.count_restart(job_id, EventReason.NODE_LOST)
        p.event(job_id, EventReason.NODE_LOST, f"lost node(s) {names(lost)}", lost)
    if drained:
        p.count_restart(job_id, EventReason.NODE_DRAINED)
        p.event(job_id, EventReason.NODE_DRAINED,
                f"node(s) {names(drained)} drained", drained)


def rebound(p: SchedulerPass, record: JobRecord) -> None:
    """Apply the user's min/max: release the surplus (the newest nodes first), and
    rewrite the bounds of the rest in place (:func:`with_bounds`: no restart)."""
    job_id = record.job_id
    spec = record.spec
    kept = p.members[job_id]
    if not kept:
        return
    surplus = len(kept) - spec.max_nodes
    released: list[str] = []
    if surplus > 0:
        newest = sorted(kept, key=lambda n: kept[n].generation, reverse=True)[:surplus]
        for node_id in newest:
            released.append(node_id)
            p.adjust(node_id, kept.pop(node_id).nproc_per_node)
        p.change(job_id).delete.extend(sorted(released))
    stale = [
        n for n, a in kept.items()
        if (a.min_nodes, a.max_nodes) != (spec.min_nodes, spec.max_nodes)
    ]
    for node_id in sorted(stale):
        kept[node_id] = with_bounds(kept[node_id], spec.min_nodes, spec.max_nodes)
        p.change(job_id).put[node_id] = kept[node_id]
        p.rebounded.setdefault(job_id, set()).add(node_id)
    if released:  # the others go on without them: a change of membership
        p.released.add(job_id)
        p.count_restart(job_id, EventReason.SCALED_BY_USER)
        p.event(
            job_id, EventReason.SCALED_BY_USER,
            f"bounds now {spec.min_nodes}..{spec.max_nodes} nodes; released {names(released)}",
            released,
        )
    # else: note_rebound, once this pass placed what it could


def note_rebound(p: SchedulerPass, record: JobRecord) -> None:
    """The event of new bounds written in place (no node released), once placed.

    Bounds whose minimum the job's nodes no longer reach, even with the
    nodes this pass gave it, give the nodes rewritten in place a new
    generation instead: their runners stop training and wait in the
    rendezvous for the minimum, as after a loss.
    """
    job_id = record.job_id
    rebounded = p.rebounded.get(job_id)
    change = p.changes.get(job_id)
    if not rebounded or change is None or job_id in p.released:
        return  # none, or rebound's event (nodes released) says it
    spec = record.spec
    kept = p.members[job_id]
    note = f"; {len(kept)} node(s) go on, nothing restarts"
    if job_id in p.grown or job_id in p.gangs or change.delete:
        note = "; the running nodes keep their runners"  # others join or leave
    if len(kept) < spec.min_nodes:
        for node_id in sorted(rebounded):
            kept[node_id] = change.put[node_id] = p.new_assignment(job_id)
        p.rebounded[job_id] = set()
        p.count_restart(job_id, EventReason.SCALED_BY_USER)
        note = f"; {len(kept)} node(s) restart to wait for {spec.min_nodes}"
    p.event(job_id, EventReason.SCALED_BY_USER,
            f"bounds now {spec.min_nodes}..{spec.max_nodes} nodes{note}")
