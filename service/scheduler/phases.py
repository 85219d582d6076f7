"""How a job ends a pass: the events of its placement (:func:`announce`), and its
phase and conditions (:func:`settle_phase`, :func:`training`).

* fewer usable nodes than its minimum: ``PENDING`` (``preempted`` when a
  reclaim took its nodes), not ``Scheduled``, ``Running`` or ``Training``;
* membership changed in this pass: ``RESCALING`` (a resize, or a restart from
  the checkpoint after a wait), or ``RUNNING`` with ``starting on`` at its start;
* every node reports running at the new size, and nothing changed: ``RUNNING``,
  its event naming the path (live or a restart); ``Training`` turns true when a
  worker of the current generation reports a step.

New bounds written in place (:func:`service.scheduler.jobs.rebound`) change no
membership.
"""

from __future__ import annotations

from rendezvous.records import JobNodeState, JobNodeStatus
from service.api.models import EventReason, JobPhase, JobRecord
from service.scheduler.reports import current_statuses, resized_live
from service.scheduler.state import SchedulerPass
from service.scheduler.types import names


def announce(p: SchedulerPass, record: JobRecord) -> None:
    """One event for the job's gang start and one for its growth in this pass."""
    job_id = record.job_id
    gang = p.gangs.pop(job_id, None)
    grown = p.grown.pop(job_id, [])
    if gang is not None:
        chosen, members = gang
        if record.started_at is None:
            p.change(job_id).record.started_at = p.now
            placed = sorted(set(p.members[job_id]) - set(grown))
            p.event(job_id, EventReason.SCHEDULED, f"scheduled on {names(placed)}",
                    placed, members=members)
        else:
            p.count_restart(job_id, EventReason.NODE_JOINED)
            p.event(job_id, EventReason.NODE_JOINED, f"node(s) {names(chosen)} joined",
                    chosen, members=members)
    if grown:
        # Growth in the very pass that starts the job (gang, then toward the
        # maximum) is written in the same transaction: nothing restarts.
        if record.started_at is not None:
            p.count_restart(job_id, EventReason.NODE_JOINED)
        p.event(job_id, EventReason.NODE_JOINED, f"node(s) {names(grown)} joined",
                sorted(grown))


def settle_phase(p: SchedulerPass, record: JobRecord) -> None:
    """The job's node map, phase and conditions at the end of the pass."""
    job_id = record.job_id
    kept = p.members[job_id]
    placed = {n: a.generation for n, a in kept.items()}
    if record.nodes != placed:
        p.change(job_id).record.nodes = placed
    spec = record.spec
    # New bounds written in place change no membership: the job stays as it is.
    changed = job_id in p.changes and bool(
        p.changes[job_id].put.keys() - p.rebounded.get(job_id, set())
        or p.changes[job_id].delete
    )
    current = p.changes[job_id].record if job_id in p.changes else record
    if len(kept) < spec.min_nodes:
        _pending(p, job_id, current, len(kept), spec.min_nodes)
        return
    nodes = names(kept)
    p.condition(job_id, "Scheduled", True, EventReason.SCHEDULED, f"on {nodes}")
    reports = current_statuses(kept, p.view.statuses.get(job_id, {}))
    training(p, job_id, reports, world=len(kept) * spec.nproc_per_node, changed=changed)
    world = len(kept) * spec.nproc_per_node
    settled = len(reports) == len(kept) and all(
        st.state == JobNodeState.RUNNING and st.world_size == world for st in reports.values()
    )
    if settled and not changed:
        # The phase's event says the path only when it was live: a restart
        # is what the job did before the live path existed.
        how = EventReason.RESIZED_LIVE if resized_live(reports) else EventReason.RESTARTED
        p.set_phase(job_id, JobPhase.RUNNING, how, f"running at world size {world}")
        p.condition(job_id, "Running", True, EventReason.RESTARTED,
                    f"world size {world} on {nodes}")
        return
    if changed or current.phase == JobPhase.PENDING:
        if current.phase != JobPhase.PENDING and record.started_at is not None:
            # Its nodes may resize live or restart (agent.runner.live_decide): not known yet.
            p.set_phase(job_id, JobPhase.RESCALING, EventReason.RESIZING,
                        f"resizing to {len(kept)} node(s)")
        elif record.started_at is not None:  # it waited: a restart from checkpoint
            p.set_phase(job_id, JobPhase.RESCALING, EventReason.RESTARTED,
                        f"restarting on {len(kept)} node(s) from the latest checkpoint")
        else:
            p.set_phase(job_id, JobPhase.RUNNING, EventReason.SCHEDULED,
                        f"starting on {nodes}")
    p.condition(job_id, "Running", False, EventReason.RESTARTED,
                f"waiting for {len(kept)} node(s) to run at world size {world}")


def _pending(
    p: SchedulerPass, job_id: str, current: JobRecord, kept: int, min_nodes: int
) -> None:
    """A job with ``kept`` nodes, below its minimum: ``PENDING``, and not
    ``Scheduled``, ``Running`` or ``Training``."""
    message = f"{kept} of at least {min_nodes} node(s) available"
    reason = EventReason.BELOW_MIN_NODES
    if job_id in p.preempted or any(
        c.type == "Scheduled" and not c.status and c.reason == EventReason.PREEMPTED
        for c in current.conditions
    ):
        reason = EventReason.PREEMPTED
        message = f"preempted; {message}"
    if current.phase != JobPhase.PENDING:
        p.set_phase(job_id, JobPhase.PENDING, reason, message)
    p.condition(job_id, "Scheduled", False, reason, message)
    p.condition(job_id, "Running", False, reason, message)
    p.condition(job_id, "Training", False, reason, message)


def training(
    p: SchedulerPass, job_id: str, reports: dict[str, JobNodeStatus], *, world: int,
    changed: bool,
) -> None:
    """``Training``: true once a worker of the current generation and size reported a step."""
    stepped = {
        node: st.last_step for node, st in reports.items()
        if st.state == JobNodeState.RUNNING and st.world_size == world
        and st.last_step is not None
    }
    if stepped and not changed:
        node = max(stepped, key=lambda n: (stepped[n] or 0, n))
        if p.view.jobs[job_id].first_step_at is None:
            p.change(job_id).record.first_step_at = p.now
        p.condition(job_id, "Training", True, EventReason.TRAINING_STARTED,
                    f"step {stepped[node]} reported by {node}")
    else:
        p.condition(job_id, "Training", False, EventReason.WAITING_FOR_FIRST_STEP,
                    "no worker of the current generation has reported a step yet")

