"""One pass of the scheduler: its working state and the bookkeeping every step shares.

A :class:`SchedulerPass` is built from one :class:`ClusterView` and lives for one
call of :func:`service.scheduler.decide` (or of :func:`service.scheduler.abandon`
and :func:`service.scheduler.note_write_failure`). The steps of the pass
(:mod:`service.scheduler.jobs`, :mod:`service.scheduler.rounds`,
:mod:`service.scheduler.placement`, :mod:`service.scheduler.reclaim`) read the
view and change this state; none of them touches etcd or reads a clock. Here:
what the pass holds (free slots, the nodes each job keeps, what each queue uses,
reservations, reclaims), and how a job's change is started and stamped
(:meth:`SchedulerPass.change`, :meth:`~SchedulerPass.event`,
:meth:`~SchedulerPass.set_phase`, :meth:`~SchedulerPass.condition`,
:meth:`~SchedulerPass.new_assignment`).
"""

from __future__ import annotations

from datetime import datetime

from rendezvous.records import Assignment
from service.api.models import ConditionType, EventReason, JobEvent, JobPhase, JobRecord
from service.api.queues import with_default
from service.scheduler.types import (
    DEFAULT_POLICY,
    ClusterView,
    JobChange,
    Policy,
    Reclaim,
    Reservation,
    assignment_for,
)


class SchedulerPass:
    """The state of one pass over ``view`` at ``now``."""

    def __init__(self, view: ClusterView, now: datetime, policy: Policy = DEFAULT_POLICY) -> None:
        self.view = view
        self.now = now
        self.policy = policy
        self.queues = with_default(view.queues)
        self.used: dict[str, int] = {}  # queue -> slots its jobs hold (this pass's members)
        self.reserved: dict[str, tuple[str, int]] = {}  # node -> (job it is reserved for, slots)
        self.reservations: list[Reservation] = []
        self.reclaims: list[Reclaim] = []
        self.preempted: set[str] = set()
        self.shrunk: set[str] = set()  # jobs that gave slots back in this pass
        self.by_queue: dict[str, list[str]] = {}  # queue -> its active jobs, in order
        self.claims: dict[str, int] = {}  # job -> slots a reclaim made room for, this pass
        self.held: dict[str, str] = {}  # node -> the job a reclaim made room on it for
        # job -> (nodes its gang start placed, its members then); job -> nodes grown
        self.gangs: dict[str, tuple[list[str], int]] = {}
        self.grown: dict[str, list[str]] = {}
        # job -> nodes whose assignment this pass rewrites in place (new bounds only):
        # not a change of membership (see scheduler_jobs.settle_phase)
        self.rebounded: dict[str, set[str]] = {}
        self.released: set[str] = set()  # jobs whose new maximum released nodes, this pass
        self.changes: dict[str, JobChange] = {}
        # node -> its `slow` mark in force (a straggler cooling down: no new placements),
        # this pass's evictions included
        self.slow = {n: m for n, m in view.slow.items() if m.in_force(now)}
        self.members: dict[str, dict[str, Assignment]] = {}  # job -> node -> assignment kept
        self.free: dict[str, int] = {}
        self.open: dict[str, int] = {}  # the nodes of ``free`` with a free slot
        # job -> nodes whose assignment this pass deletes because the node left the
        # job; see scheduler_placement.fits.
        self.left: dict[str, set[str]] = {}
        # job -> the first generation no assignment of it holds (see new_assignment)
        self.generation_floor: dict[str, int] = {
            job_id: max(a.generation for a in per_node.values()) + 1
            for job_id, per_node in view.assignments.items() if per_node
        }

    def change(self, job_id: str) -> JobChange:
        """The job's change in this pass, started (from a copy of its record) if need be."""
        if job_id not in self.changes:
            record = self.view.jobs[job_id].model_copy(deep=True)
            # Any record written counts the generations its assignments hold, so
            # that none is forgotten once they are deleted (see new_assignment).
            record.next_generation = max(
                record.next_generation, self.generation_floor.get(job_id, 1)
            )
            self.changes[job_id] = JobChange(job_id, record)
        return self.changes[job_id]

    def event(
        self, job_id: str, reason: EventReason, message: str, nodes: list[str] | None = None,
        *, members: int | None = None,
    ) -> None:
        """Append an event; ``members``: the job's nodes, if not those this pass kept."""
        change = self.change(job_id)
        record = change.record
        if members is None:
            members = len(self.members.get(job_id, {}))
        change.events.append(
            JobEvent(
                seq=record.next_event, time=self.now, phase=record.phase, reason=reason,
                message=message, nodes=sorted(nodes or []),
                world_size=members * record.spec.nproc_per_node,
            )
        )
        record.next_event += 1

    def set_phase(self, job_id: str, phase: JobPhase, reason: EventReason, message: str) -> None:
        """Move the job to ``phase`` (with an event), unless it is there already."""
        # Checked before change(): a settled job's phase is unchanged in most
        # passes, and change() deep-copies the record.
        current = self.changes[job_id].record if job_id in self.changes else self.view.jobs[job_id]
        if current.phase == phase:
            return
        record = self.change(job_id).record
        record.phase.check_transition(phase)
        record.phase = phase
        if phase.is_terminal():
            record.finished_at = self.now
        self.event(job_id, reason, message)

    def condition(
        self, job_id: str, type_: ConditionType, status: bool, reason: EventReason, message: str
    ) -> None:
        """Set one of the job's conditions, if it differs."""
        record = self.changes[job_id].record if job_id in self.changes else self.view.jobs[job_id]
        # Checked before change(): most passes change nothing for most jobs,
        # and change() deep-copies the record.
        if record.condition_differs(type_, status, reason.value):
            self.change(job_id).record.set_condition(
                type_, status, reason.value, message, now=self.now
            )

    def new_assignment(self, job_id: str) -> Assignment:
        """An assignment of the job at a generation it never used."""
        record = self.change(job_id).record
        # change() counted in the generations the job's assignments hold: never
        # reuse one (an agent would take a changed assignment for the one it
        # already ran).
        generation = record.next_generation
        record.next_generation = generation + 1
        return assignment_for(record, generation)

    def adjust(self, node_id: str, delta: int) -> None:
        """Change a node's free slots, keeping :attr:`open` (nodes with any free) in step."""
        free = self.free.get(node_id, 0) + delta
        self.free[node_id] = free
        if free > 0:
            self.open[node_id] = free
        else:
            self.open.pop(node_id, None)

    def below_min(self, record: JobRecord) -> bool:
        """Whether the job holds fewer nodes than its minimum (in this pass)."""
        return len(self.members[record.job_id]) < record.spec.min_nodes

    def count_restart(self, job_id: str, reason: EventReason) -> None:
        """Count one restart of the job, by ``reason``."""
        record = self.change(job_id).record
        record.restarts[reason.value] = record.restarts.get(reason.value, 0) + 1
