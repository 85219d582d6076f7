"""The scheduler's decision: a pure function from what etcd holds to the changes to make.

:func:`plan` takes a :class:`ClusterView` (jobs, live nodes, drains, current
assignments and what the agents report) and returns one :class:`JobChange`
per job that needs one. It reads no clock but the ``now`` it is given, touches
no etcd, and is unit-tested (and property-tested) on its own; the
reconcile loop (:mod:`service.coordinator.reconciler`) reads etcd, calls it, and writes the
changes in fenced transactions.

The rules, level-triggered (the same view always gives the same plan):

* a job whose cancel was requested, or whose agents report success or an
  exhausted restart budget, ends; its assignments are removed;
* an assignment on a node that is gone (lease expired) or that left the job
  (its runner stopped) is removed: the job shrinks; one on a draining node is
  removed too (the agent drains it: SIGTERM, checkpoint, exit);
* when the user changed min/max, nodes beyond the new maximum are released,
  the newest first (like a drain), and the job's remaining assignments are
  rewritten *in place* with the new bounds, at the generation they hold
  (:func:`with_bounds`): an agent restarts a runner only for a new
  generation, and a runner follows its assignment's bounds while it runs
  (agent.bounds), so a PATCH that changes no membership restarts nothing
  (but a minimum the job's nodes no longer reach, even with free ones, gives
  them a new generation: their runners stop and wait for it, as after a loss);
* free capacity goes first to jobs that are below their minimum, as a gang
  (a job gets nodes only if its minimum fits), then to growing jobs toward
  their maximum; both in order of priority, then submission time (FIFO);
* a running job's straggler (a node slower than the others, by its policy) is
  evicted as by a drain, its node marked ``slow`` and given no new placement
  for a cool-down, or only reported (:mod:`service.scheduler.stragglers`);
* a job with fewer usable nodes than its minimum is ``PENDING``; one whose
  membership just changed is ``RESCALING`` until every node reports running
  at the new size, then ``RUNNING``; its ``Training`` condition turns true
  when a worker of the current generation reports a step;
* a restart an agent charged to a node's budget (``worker_failed`` in its
  status) is added to the job's ``restarts`` and gets a ``restart_charged``
  event, once: the record keeps how many of each node's current generation it
  counted (:func:`restart_charges`);
* every assignment gets a generation above any the job's record or its
  assignments hold, so a pass cut half-way through a split write (see
  :mod:`service.coordinator.reconciler`) never hands out one twice.

:func:`abandon` is the decision for a job whose writes etcd keeps refusing:
it ends ``FAILED`` (its reason names the refusal) and releases its nodes.
Messages list at most :data:`MAX_NAMES_IN_MESSAGE` nodes, so a job of
thousands of nodes never makes an event or condition too big to store.

The pass is split by concern, each module a step over one
:class:`~service.scheduler.state.SchedulerPass`: the values in
:mod:`service.scheduler.types`; each job's membership and reports in
:mod:`service.scheduler.jobs`; the order slots are given out in (guarantees,
reservations, borrowing by weight) in :mod:`service.scheduler.rounds`, over the
queue accounting of :mod:`service.scheduler.quota`, the placement of
:mod:`service.scheduler.placement` and the reclaims of
:mod:`service.scheduler.reclaim`; the phases and conditions a job ends in, in
:mod:`service.scheduler.phases`. This module runs the pass and is the one to
import from.
"""

from __future__ import annotations

from datetime import datetime

from rendezvous.records import Assignment
from service.api.models import ConditionType, EventReason, ExitReason, JobPhase, JobRecord
from service.scheduler.jobs import (
    count_charges,
    count_resizes,
    failure_message,
    finish_if_done,
    keep_usable,
    note_rebound,
    rebound,
)
from service.scheduler.phases import announce, settle_phase
from service.scheduler.quota import hold
from service.scheduler.rounds import place
from service.scheduler.state import SchedulerPass
from service.scheduler.stragglers import act_on_stragglers
from service.scheduler.types import (
    DEFAULT_POLICY,
    MAX_ERROR_TEXT,
    MAX_NAMES_IN_MESSAGE,
    RESERVE_AFTER_S,
    STRAGGLER_COOLDOWN_S,
    ClusterView,
    Decision,
    JobChange,
    Policy,
    Reclaim,
    Reservation,
    assignment_for,
    clip,
    job_order,
    names,
    view_usage,
    waiting_since,
    with_bounds,
)

__all__ = [
    "DEFAULT_POLICY",
    "MAX_ERROR_TEXT",
    "MAX_NAMES_IN_MESSAGE",
    "RESERVE_AFTER_S",
    "STRAGGLER_COOLDOWN_S",
    "ClusterView",
    "Decision",
    "JobChange",
    "Policy",
    "Reclaim",
    "Reservation",
    "abandon",
    "assignment_for",
    "decide",
    "failure_message",
    "job_order",
    "names",
    "note_write_failure",
    "plan",
    "view_usage",
    "waiting_since",
    "with_bounds",
]


def plan(view: ClusterView, now: datetime, policy: Policy = DEFAULT_POLICY) -> list[JobChange]:
    """Decide what to change so that assignments match the jobs and the live nodes.

    Args:
        view: jobs, live nodes, drains, assignments, agent reports and queues.
        now: the time stamped on events and records (and the clock of reservations).
        policy: the scheduler's tunables.

    Returns:
        One :class:`JobChange` per job that needs a write, highest priority first.
    """
    return decide(view, now, policy).changes


def decide(view: ClusterView, now: datetime, policy: Policy = DEFAULT_POLICY) -> Decision:
    """:func:`plan`, with the reservations and reclaims it made on the way."""
    p = SchedulerPass(view, now, policy)
    changes = _run(p)
    return Decision(changes, p.reservations, p.reclaims)


def _run(p: SchedulerPass) -> list[JobChange]:
    """One pass: each job's own steps, the rounds that place, then each job's phase."""
    view = p.view
    for node_id, info in view.nodes.items():
        if node_id not in view.draining:
            p.adjust(node_id, info.slots)
    active = [record for record in sorted(view.jobs.values(), key=job_order)
              if _still_active(p, record, view.assignments.get(record.job_id, {}))]
    for record in active:
        rebound(p, record)
        act_on_stragglers(p, record)
    for record in active:
        hold(p, record, len(p.members[record.job_id]))
    for record in active:
        p.by_queue.setdefault(record.spec.queue, []).append(record.job_id)
    place(p, active)
    for record in active:
        note_rebound(p, record)
        announce(p, record)
        settle_phase(p, record)
    # A job's change is created by whichever step touches it first, so the
    # dict's order is not the jobs' order: sort, as plan() promises.
    return sorted(
        (c for c in p.changes.values() if _is_change(p, c)),
        key=lambda c: job_order(view.jobs[c.job_id]),
    )


def _still_active(p: SchedulerPass, record: JobRecord, assigned: dict[str, Assignment]) -> bool:
    """Fold the job's reports, end it if it is done, keep its usable nodes; whether
    it goes on (and takes part in the rounds)."""
    if record.phase.is_terminal():
        if assigned:  # a leftover of an interrupted write: finish the job's exit
            p.change(record.job_id).delete.extend(sorted(assigned))
        return False
    count_charges(p, record, assigned)
    count_resizes(p, record, assigned)
    if finish_if_done(p, record, assigned):
        return False
    keep_usable(p, record, assigned)
    return True


def _is_change(p: SchedulerPass, change: JobChange) -> bool:
    return bool(change.put or change.delete or change.events) or (
        change.record != p.view.jobs[change.job_id]
    )


def note_write_failure(
    view: ClusterView, job_id: str, error: str, attempt: int, limit: int, now: datetime
) -> JobChange:
    """Record on a job that etcd refused its change: an event and its ``Scheduled`` condition.

    Args:
        view: the cluster, as for :func:`plan`.
        job_id: the job; must be in ``view.jobs``.
        error: etcd's refusal.
        attempt / limit: how many passes in a row failed, and after how many
            the job is failed (:func:`abandon`).
        now: the time stamped on the event.
    """
    p = SchedulerPass(view, now)
    change = p.change(job_id)
    message = (f"etcd refused the job's change ({attempt} of {limit} tries before the job "
               f"fails): {clip(error)}")
    change.record.set_condition("Scheduled", False, EventReason.WRITE_FAILED.value, message,
                                now=now)
    p.event(job_id, EventReason.WRITE_FAILED, message)
    return change


def abandon(view: ClusterView, job_id: str, error: str, now: datetime) -> JobChange:
    """End a job whose writes etcd keeps refusing: ``FAILED``, its nodes released.

    The change is small whatever the job: the record as the API stored it
    (which etcd took), no node map, one event, the assignments' deletes. A job
    that already ended only has its leftover assignments deleted.

    Args:
        view: the cluster, as for :func:`plan`.
        job_id: the job; must be in ``view.jobs``.
        error: why its writes failed (etcd's refusal), quoted in its status.
        now: the time stamped on the record and the event.
    """
    p = SchedulerPass(view, now)
    change = p.change(job_id)
    change.delete = sorted(view.assignments.get(job_id, {}))
    record = change.record
    if record.phase.is_terminal():
        return change
    message = f"etcd refused the job's writes; it cannot be scheduled: {clip(error)}"
    reason = EventReason.WRITE_FAILED.value
    p.members[job_id] = {}
    record.nodes = {}
    record.exit_reason = ExitReason.UNSCHEDULABLE
    off: tuple[ConditionType, ...] = ("Scheduled", "Running", "Training")
    for type_ in off:
        record.set_condition(type_, False, reason, message, now=now)
    record.set_condition("Finished", True, reason, message, now=now)
    p.set_phase(job_id, JobPhase.FAILED, EventReason.WRITE_FAILED, message)
    return change
