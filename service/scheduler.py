"""The scheduler's decision: a pure function from what etcd holds to the changes to make.

:func:`plan` takes a :class:`ClusterView` (jobs, live nodes, drains, current
assignments and what the agents report) and returns one :class:`JobChange`
per job that needs one. It reads no clock but the ``now`` it is given, touches
no etcd, and is unit-tested (and property-tested) on its own; the
reconcile loop (:mod:`service.reconciler`) reads etcd, calls it, and writes the
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
  :mod:`service.reconciler`) never hands out one twice.

:func:`abandon` is the decision for a job whose writes etcd keeps refusing:
it ends ``FAILED`` (its reason names the refusal) and releases its nodes.
Messages list at most :data:`MAX_NAMES_IN_MESSAGE` nodes, so a job of
thousands of nodes never makes an event or condition too big to store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from rendezvous.gpus import gpus_free
from rendezvous.records import RUNNER_RANK, Assignment, JobNodeState, JobNodeStatus
from rendezvous.registry import NodeInfo
from service.job_reports import (
    CHARGED_REASON,
    current_statuses,
    resize_rises,
    resized_live,
    restart_charges,
)
from service.models import (
    ConditionType,
    EventReason,
    ExitReason,
    JobEvent,
    JobPhase,
    JobRecord,
)
from service.queues import QueueSpec, Usage, queue_usage, with_default


@dataclass(frozen=True)
class ClusterView:
    """Everything the scheduler decides on. Build it from etcd (or by hand in tests)."""

    jobs: dict[str, JobRecord]
    nodes: dict[str, NodeInfo]
    draining: frozenset[str] = frozenset()
    assignments: dict[str, dict[str, Assignment]] = field(default_factory=dict)  # job -> node ->
    statuses: dict[str, dict[str, JobNodeStatus]] = field(default_factory=dict)  # job -> node ->
    queues: dict[str, QueueSpec] = field(default_factory=dict)  # name -> (default: implicit)


#: How long a job that cannot fit waits before its nodes are reserved (see Policy).
RESERVE_AFTER_S = 60.0


@dataclass(frozen=True)
class Policy:
    """The scheduler's tunables (the defaults are the coordinator's).

    ``reserve_after_s``: a waiting job that has not fitted for this long gets a
    reservation (:class:`Reservation`); ``math.inf`` turns reservations off.
    """

    reserve_after_s: float = RESERVE_AFTER_S


@dataclass(frozen=True)
class Reservation:
    """Nodes held for a waiting job: no job borrowing beyond its queue's guarantee
    starts or grows on them, so the job starts once the work already there ends."""

    job_id: str
    nodes: frozenset[str]


@dataclass(frozen=True)
class Reclaim:
    """Slots taken back from ``victim`` (shrunk, or ``preempted`` whole) for ``waiter``."""

    victim: str
    waiter: str
    nodes: tuple[str, ...]
    preempted: bool
    cross_queue: bool


@dataclass
class JobChange:
    """What to write for one job, in one transaction."""

    job_id: str
    record: JobRecord  # the record to write (compared against its mod revision)
    put: dict[str, Assignment] = field(default_factory=dict)  # node -> new assignment
    delete: list[str] = field(default_factory=list)  # nodes whose assignment goes
    events: list[JobEvent] = field(default_factory=list)
    # the job whose waiting made this job give slots back (see Reclaim), if any
    reclaimed_for: str | None = None

    @property
    def decisions(self) -> int:
        return len(self.put) + len(self.delete)


def assignment_for(record: JobRecord, generation: int) -> Assignment:
    """The assignment a node gets for ``record``'s job."""
    spec = record.spec
    env = dict(spec.env)
    if spec.resize_policy is not None:
        env.update(spec.resize_policy.env())
    return Assignment(
        job_id=record.job_id,
        generation=generation,
        command=spec.command,
        cwd=record.cwd,
        env=env,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        gpus_per_node=spec.gpus_per_node,
        max_restarts=spec.max_restarts,
        checkpoint_dir=record.checkpoint_path,
        grace_period_s=spec.grace_period_s,
    )


def with_bounds(assignment: Assignment, min_nodes: int, max_nodes: int) -> Assignment:
    """``assignment`` with new bounds and nothing else changed, its generation included.

    The agent of its node keeps the runner it runs (it compares generations)
    and the runner takes the bounds over (agent.bounds): new bounds alone
    restart nothing.
    """
    return assignment.model_copy(update={"min_nodes": min_nodes, "max_nodes": max_nodes})


#: Nodes a message lists by name; the rest are counted ("and 280 more").
MAX_NAMES_IN_MESSAGE = 16
#: Longest error text an event or condition quotes.
MAX_ERROR_TEXT = 1024


def names(nodes: Iterable[str]) -> str:
    """Node ids for a message, sorted, at most :data:`MAX_NAMES_IN_MESSAGE` of them."""
    ordered = sorted(nodes)
    shown = ", ".join(ordered[:MAX_NAMES_IN_MESSAGE])
    rest = len(ordered) - MAX_NAMES_IN_MESSAGE
    return f"{shown} and {rest} more" if rest > 0 else shown


def _order(record: JobRecord) -> tuple[int, datetime, str]:
    return (-record.spec.priority, record.created_at, record.job_id)


def view_usage(view: ClusterView) -> dict[str, Usage]:
    """Slots each queue's unfinished jobs hold and wait for (:func:`service.queues.queue_usage`)."""
    return queue_usage(
        ((r.job_id, r.spec.queue, r.spec.min_nodes, r.spec.nproc_per_node,
          r.phase.is_terminal()) for r in view.jobs.values()),
        view.assignments,
    )


def waiting_since(record: JobRecord) -> datetime:
    """When a job below its minimum began to wait: its submission, or when it lost
    its ``Scheduled`` condition (a preemption, lost nodes)."""
    for cond in record.conditions:
        if cond.type == "Scheduled" and not cond.status:
            return cond.last_transition_time
    return record.created_at


@dataclass
class Decision:
    """What :func:`decide` chose: the changes, and why (for tests and the simulator)."""

    changes: list[JobChange]
    reservations: list[Reservation]
    reclaims: list[Reclaim]


class _Planner:
    def __init__(self, view: ClusterView, now: datetime, policy: Policy = Policy()) -> None:
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
        # not a change of membership (see _settle_phase)
        self.rebounded: dict[str, set[str]] = {}
        self.released: set[str] = set()  # jobs whose new maximum released nodes, this pass
        self.changes: dict[str, JobChange] = {}
        self.members: dict[str, dict[str, Assignment]] = {}  # job -> node -> assignment kept
        self.free: dict[str, int] = {}
        self.open: dict[str, int] = {}  # the nodes of ``free`` with a free slot
        # job -> nodes whose assignment this pass deletes because the node left the
        # job; see _fits.
        self.left: dict[str, set[str]] = {}
        # job -> the first generation no assignment of it holds (see new_assignment)
        self.generation_floor: dict[str, int] = {
            job_id: max(a.generation for a in per_node.values()) + 1
            for job_id, per_node in view.assignments.items() if per_node
        }

    # bookkeeping -------------------------------------------------------------------

    def change(self, job_id: str) -> JobChange:
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

    def new_assignment(self, job_id: str) -> Assignment:
        record = self.change(job_id).record
        # change() counted in the generations the job's assignments hold: never
        # reuse one (an agent would take a changed assignment for the one it
        # already ran).
        generation = record.next_generation
        record.next_generation = generation + 1
        return assignment_for(record, generation)

    def _adjust(self, node_id: str, delta: int) -> None:
        """Change a node's free slots, keeping :attr:`open` (nodes with any free) in step."""
        free = self.free.get(node_id, 0) + delta
        self.free[node_id] = free
        if free > 0:
            self.open[node_id] = free
        else:
            self.open.pop(node_id, None)

    def count_restart(self, job_id: str, reason: EventReason) -> None:
        record = self.change(job_id).record
        record.restarts[reason.value] = record.restarts.get(reason.value, 0) + 1

    # the plan ----------------------------------------------------------------------

    def run(self) -> list[JobChange]:
        view = self.view
        for node_id, info in view.nodes.items():
            if node_id not in view.draining:
                self._adjust(node_id, info.slots)
        active: list[JobRecord] = []
        for record in sorted(view.jobs.values(), key=_order):
            assigned = view.assignments.get(record.job_id, {})
            if record.phase.is_terminal():
                if assigned:  # a leftover of an interrupted write: finish the job's exit
                    self.change(record.job_id).delete.extend(sorted(assigned))
                continue
            self._count_charges(record, assigned)
            self._count_resizes(record, assigned)
            if self._finish_if_done(record, assigned):
                continue
            self._keep_usable(record, assigned)
            active.append(record)
        for record in active:
            self._rebound(record)
        for record in active:
            self._hold(record, len(self.members[record.job_id]))
        for record in active:
            self.by_queue.setdefault(record.spec.queue, []).append(record.job_id)
        self._place(active)
        for record in active:
            self._note_rebound(record)
            self._announce(record)
            self._settle_phase(record)
        # A job's change is created by whichever step touches it first, so the
        # dict's order is not the jobs' order: sort, as plan() promises.
        return sorted(
            (c for c in self.changes.values() if self._is_change(c)),
            key=lambda c: _order(view.jobs[c.job_id]),
        )

    def _is_change(self, change: JobChange) -> bool:
        return bool(change.put or change.delete or change.events) or (
            change.record != self.view.jobs[change.job_id]
        )

    def _count_charges(self, record: JobRecord, assigned: dict[str, Assignment]) -> None:
        """Add the restarts the agents charged since the last pass to the job's
        ``restarts``, with one ``restart_charged`` event per node whose count rose."""
        job_id = record.job_id
        generations = {n: a.generation for n, a in assigned.items()}
        folded, rises = restart_charges(
            record.charged, generations, self.view.statuses.get(job_id, {})
        )
        if folded == record.charged:
            return
        change = self.change(job_id)
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
                message += f": {_clip(error.message)}"
            self.event(job_id, EventReason.RESTART_CHARGED, message, [charge.node_id],
                       members=len(assigned))  # before this pass decides who stays

    def _count_resizes(self, record: JobRecord, assigned: dict[str, Assignment]) -> None:
        """One event per path the nodes' membership changes took since the last pass."""
        job_id = record.job_id
        generations = {n: a.generation for n, a in assigned.items()}
        folded, rises = resize_rises(
            record.resized, generations, self.view.statuses.get(job_id, {})
        )
        if folded == record.resized:
            return
        self.change(job_id).record.resized = folded
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
                    message += f": {_clip('; '.join(causes))}"
            self.event(job_id, reason, message, nodes, members=len(assigned))

    def _finish_if_done(self, record: JobRecord, assigned: dict[str, Assignment]) -> bool:
        job_id = record.job_id
        reports = current_statuses(assigned, self.view.statuses.get(job_id, {}))
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
            self.change(job_id).record.error = first.error
            outcome = (JobPhase.FAILED, ExitReason.WORKER_FAILED, EventReason.WORKER_FAILED,
                       failure_message(first))
        phase, exit_reason, reason, message = outcome
        change = self.change(job_id)
        change.record.exit_reason = exit_reason
        change.record.set_condition("Finished", True, reason.value, message, now=self.now)
        change.record.set_condition("Running", False, reason.value, message, now=self.now)
        change.record.set_condition("Training", False, reason.value, message, now=self.now)
        self.members[job_id] = {}
        change.record.nodes = {}
        self.set_phase(job_id, phase, reason, message)
        change.delete.extend(sorted(assigned))
        return True

    def _keep_usable(self, record: JobRecord, assigned: dict[str, Assignment]) -> None:
        """Drop assignments on nodes that are gone, draining, or that left the job."""
        job_id = record.job_id
        view = self.view
        reports = current_statuses(assigned, view.statuses.get(job_id, {}))
        kept: dict[str, Assignment] = {}
        lost: list[str] = []
        drained: list[str] = []
        for node_id, assignment in sorted(assigned.items()):
            left = node_id in reports and reports[node_id].state == JobNodeState.CANCELLED
            if node_id not in view.nodes or left:
                lost.append(node_id)
                if left:
                    self.left.setdefault(job_id, set()).add(node_id)
            elif node_id in view.draining:
                drained.append(node_id)
            else:
                kept[node_id] = assignment
                self._adjust(node_id, -assignment.nproc_per_node)
        self.members[job_id] = kept
        change = self.change(job_id) if (lost or drained) else None
        if change is not None:
            change.delete.extend(lost + drained)
        if lost:
            self.count_restart(job_id, EventReason.NODE_LOST)
            self.event(job_id, EventReason.NODE_LOST, f"lost node(s) {names(lost)}", lost)
        if drained:
            self.count_restart(job_id, EventReason.NODE_DRAINED)
            self.event(job_id, EventReason.NODE_DRAINED,
                       f"node(s) {names(drained)} drained", drained)

    def _rebound(self, record: JobRecord) -> None:
        """Apply the user's min/max: release the surplus (the newest nodes first), and
        rewrite the bounds of the rest in place (:func:`with_bounds`: no restart)."""
        job_id = record.job_id
        spec = record.spec
        kept = self.members[job_id]
        if not kept:
            return
        surplus = len(kept) - spec.max_nodes
        released: list[str] = []
        if surplus > 0:
            newest = sorted(kept, key=lambda n: kept[n].generation, reverse=True)[:surplus]
            for node_id in newest:
                released.append(node_id)
                self._adjust(node_id, kept.pop(node_id).nproc_per_node)
            self.change(job_id).delete.extend(sorted(released))
        stale = [
            n for n, a in kept.items()
            if (a.min_nodes, a.max_nodes) != (spec.min_nodes, spec.max_nodes)
        ]
        for node_id in sorted(stale):
            kept[node_id] = with_bounds(kept[node_id], spec.min_nodes, spec.max_nodes)
            self.change(job_id).put[node_id] = kept[node_id]
            self.rebounded.setdefault(job_id, set()).add(node_id)
        if released:  # the others go on without them: a change of membership
            self.released.add(job_id)
            self.count_restart(job_id, EventReason.SCALED_BY_USER)
            self.event(
                job_id, EventReason.SCALED_BY_USER,
                f"bounds now {spec.min_nodes}..{spec.max_nodes} nodes; released {names(released)}",
                released,
            )
        # else: _note_rebound, once this pass placed what it could

    def _note_rebound(self, record: JobRecord) -> None:
        """The event of new bounds written in place (no node released), once placed.

        Bounds whose minimum the job's nodes no longer reach, even with the
        nodes this pass gave it, give the nodes rewritten in place a new
        generation instead: their runners stop training and wait in the
        rendezvous for the minimum, as after a loss.
        """
        job_id = record.job_id
        rebounded = self.rebounded.get(job_id)
        change = self.changes.get(job_id)
        if not rebounded or change is None or job_id in self.released:
            return  # none, or _rebound's event (nodes released) says it
        spec = record.spec
        kept = self.members[job_id]
        note = f"; {len(kept)} node(s) go on, nothing restarts"
        if job_id in self.grown or job_id in self.gangs or change.delete:
            note = "; the running nodes keep their runners"  # others join or leave
        if len(kept) < spec.min_nodes:
            for node_id in sorted(rebounded):
                kept[node_id] = change.put[node_id] = self.new_assignment(job_id)
            self.rebounded[job_id] = set()
            self.count_restart(job_id, EventReason.SCALED_BY_USER)
            note = f"; {len(kept)} node(s) restart to wait for {spec.min_nodes}"
        self.event(job_id, EventReason.SCALED_BY_USER,
                   f"bounds now {spec.min_nodes}..{spec.max_nodes} nodes{note}")

    # queues --------------------------------------------------------------------------

    def _queue(self, record: JobRecord) -> QueueSpec:
        """The job's queue; one that is gone guarantees nothing and limits nothing."""
        name = record.spec.queue
        return self.queues.get(name) or QueueSpec(name=name, created_at=record.created_at)

    def _hold(self, record: JobRecord, nodes: int) -> None:
        """Count ``nodes`` more (or fewer) nodes of the job against its queue."""
        name = record.spec.queue
        self.used[name] = self.used.get(name, 0) + nodes * record.spec.nproc_per_node

    def _limit_room(self, record: JobRecord) -> int:
        """Slots the job's queue may still take before its limit."""
        queue = self._queue(record)
        if queue.limit is None:
            return 1 << 62
        return max(0, queue.limit - self.used.get(queue.name, 0))

    def _borrowed(self, name: str) -> float:
        """Slots the queue holds beyond its guarantee, per unit of weight."""
        queue = self.queues.get(name) or QueueSpec(name=name)
        return max(0, self.used.get(name, 0) - queue.guaranteed) / queue.weight

    def _claimed(self, name: str) -> int:
        """Slots reclaims of this pass made room for, for jobs of the queue."""
        return sum(n for j, n in self.claims.items() if self.view.jobs[j].spec.queue == name)

    def _below_min(self, record: JobRecord) -> bool:
        return len(self.members[record.job_id]) < record.spec.min_nodes

    def _ahead(self, record: JobRecord) -> int:
        """Slots held by the job and by the jobs before it in its queue's order
        (priority, then submission), and the room reclaims made for those this pass."""
        total = 0
        mine = _order(record)
        for job_id in self.by_queue.get(record.spec.queue, ()):
            other = self.view.jobs[job_id]
            if job_id == record.job_id or _order(other) < mine:
                total += len(self.members[job_id]) * other.spec.nproc_per_node
                total += self.claims.get(job_id, 0)
        return total

    def _owed(self, record: JobRecord) -> bool:
        """Whether the job's start is within its queue's guarantee (see :meth:`_reclaim`)."""
        spec = record.spec
        if self._queue(record).guaranteed == 0:
            return False
        need = (spec.min_nodes - len(self.members[record.job_id])) * spec.nproc_per_node
        return self._ahead(record) + need <= self._queue(record).guaranteed

    def _share(self, record: JobRecord) -> int:
        """Slots of the job's queue's guarantee left for it by the jobs before it
        (in priority, then submission order): what it holds within the guarantee."""
        before = 0
        mine = _order(record)
        for job_id in self.by_queue.get(record.spec.queue, ()):
            kept = self.members[job_id]
            other = self.view.jobs[job_id]
            if kept and _order(other) < mine:
                before += len(kept) * other.spec.nproc_per_node
        return max(0, self._queue(record).guaranteed - before)

    # placing -------------------------------------------------------------------------

    def _place(self, active: list[JobRecord]) -> None:
        """Give out free slots: guarantees first (reclaiming borrowed slots for a
        job that waits within its queue's guarantee), then reservations for jobs
        that waited too long, then idle slots to everyone, shared by weight."""
        for record in active:
            if record.job_id in self.shrunk:
                continue  # it just gave its slots back: it does not take others'
            if self._below_min(record) and self._owed(record) and not self._grow(
                record, to_min_only=True
            ):
                self._reclaim(record)
        for record in active:
            if record.job_id in self.shrunk:
                continue  # it just gave slots back: it does not take others
            room = (self._queue(record).guaranteed - self.used.get(record.spec.queue, 0)
                    - self._claimed(record.spec.queue))
            if room >= record.spec.nproc_per_node and not self._below_min(record):
                self._grow(record, to_min_only=False, most=room // record.spec.nproc_per_node)
        self._reserve(active)
        self._borrow(active)

    def _reserved_away(self, node_id: str, record: JobRecord) -> bool:
        """Whether the job would take slots of ``node_id`` reserved for another job."""
        held = self.reserved.get(node_id)
        if held is None or held[0] == record.job_id:
            return False
        return self.free[node_id] - held[1] < record.spec.nproc_per_node

    def _borrow(self, active: list[JobRecord]) -> None:
        """Idle slots to the queues by weight: the queue with the fewest borrowed
        slots per weight places next (a gang start, else one node of growth),
        in its own order of priority then submission."""
        gangs: dict[str, list[JobRecord]] = {}
        claiming = {self.view.jobs[j].spec.queue for j in self.claims}
        for record in active:
            # A job that gave its slots back this pass takes none; a queue for which
            # a reclaim made room borrows nothing more until that room is used.
            if record.job_id not in self.shrunk and record.spec.queue not in claiming:
                gangs.setdefault(record.spec.queue, []).append(record)
        growing: dict[str, list[JobRecord]] = {}
        while gangs or growing:
            name = min({*gangs, *growing}, key=lambda q: (self._borrowed(q), q))
            if name in gangs:
                # Free slots only shrink within a pass: a job that did not fit
                # now never will in this pass, so each is tried once.
                jobs = gangs[name]
                while jobs and not (
                    self._below_min(jobs[0])
                    and self._grow(jobs[0], to_min_only=True, borrowing=True)
                ):
                    jobs.pop(0)
                if jobs:
                    jobs.pop(0)
                    continue
                del gangs[name]
                growing[name] = [
                    r for r in active if r.spec.queue == name and r.job_id not in self.shrunk
                ]
                continue
            jobs = growing[name]
            while jobs and not self._grow(jobs[0], to_min_only=False, most=1, borrowing=True):
                jobs.pop(0)
            if not jobs:
                del growing[name]

    def _reserve(self, active: list[JobRecord]) -> None:
        """Reserve nodes for the first job of each queue that has waited
        ``policy.reserve_after_s`` without fitting: the nodes with the most free
        slots among those it could run on, not reserved for another job."""
        if math.isinf(self.policy.reserve_after_s):
            return
        patience = timedelta(seconds=self.policy.reserve_after_s)
        served: set[str] = set()
        for record in active:
            spec = record.spec
            job_id = record.job_id
            if spec.queue in served or not self._below_min(record) or job_id in self.preempted:
                continue
            served.add(spec.queue)  # the first waiting job of its queue, or none
            if self.now - waiting_since(record) < patience:
                continue
            need = spec.min_nodes - len(self.members[job_id])
            if need * spec.nproc_per_node > self._limit_room(record):
                continue
            usable = sorted(
                (n for n, info in self.view.nodes.items()
                 if n in self.free and n not in self.reserved
                 and info.slots >= spec.nproc_per_node
                 and n not in self.members[job_id] and n not in self.left.get(job_id, ())
                 and all(info.labels.get(k) == v for k, v in spec.node_selector.items())),
                key=lambda n: (-self.free[n], n),
            )
            if len(usable) < need:
                continue  # it could not run even on an idle cluster (as it is now)
            chosen = usable[:need]
            for node_id in chosen:
                self.reserved[node_id] = (job_id, spec.nproc_per_node)
            self.reservations.append(Reservation(job_id, frozenset(chosen)))

    # reclaiming ----------------------------------------------------------------------

    def _reclaim(self, waiter: JobRecord) -> None:
        """Take slots back for a job that waits within its queue's guarantee.

        From other queues, at most what its queue is owed (its guarantee less
        what it holds), and only slots those queues hold beyond their own
        guarantees; from its own queue, from jobs of lower priority. First by
        shrinking elastic jobs toward their minimum, one node at a time, then
        by preempting whole jobs; lowest priority first, newest first. Nothing
        is taken unless the job then fits; the slots freed are held for it
        (nobody gets them in this pass; it starts in the next one).
        """
        queue = self._queue(waiter)
        owed = max(0, queue.guaranteed - self.used.get(queue.name, 0) - self._claimed(queue.name))
        victims = [  # a job gives slots back once a pass
            self.view.jobs[j] for j, kept in self.members.items()
            if kept and j != waiter.job_id and j not in self.shrunk
            and not self._below_min(self.view.jobs[j])
        ]

        def cross(v: JobRecord) -> bool:
            return v.spec.queue != queue.name

        def eligible(v: JobRecord) -> bool:
            if cross(v):
                return owed > 0 and self._share(v) < len(self.members[v.job_id]) * (
                    v.spec.nproc_per_node)
            return v.spec.priority < waiter.spec.priority

        victims = [v for v in victims if eligible(v)]
        victims.sort(key=lambda v: (not cross(v), -self._borrowed(v.spec.queue),
                                    v.spec.priority, -v.created_at.timestamp(), v.job_id))
        steps: list[tuple[JobRecord, list[str]]] = []
        taken = 0  # slots from other queues
        for v in victims:  # shrinks
            kept = self.members[v.job_id]
            nproc = v.spec.nproc_per_node
            floor = v.spec.min_nodes
            if cross(v):
                floor = max(floor, -(-self._share(v) // nproc))
            spare = len(kept) - floor
            others = [per_node for j, per_node in self.members.items() if j != v.job_id]
            useful = sorted(  # nodes the waiter could use were this victim not there
                (n for n in kept
                 if self._fits(waiter, n, {n: self.view.nodes[n].slots}, others)),
                key=lambda n: (-kept[n].generation, n),
            )
            for node_id in useful[:max(0, spare)]:
                if cross(v) and taken >= owed:
                    break
                steps.append((v, [node_id]))
                taken += nproc if cross(v) else 0
                if self._fits_after(waiter, steps):
                    self._commit_reclaim(waiter, self._minimal(waiter, steps))
                    return
        for v in reversed(victims):  # preemptions: lowest priority, newest first
            if cross(v) and (taken >= owed or self._share(v) >= v.spec.min_nodes * (
                    v.spec.nproc_per_node)):
                continue  # within its guarantee at its minimum: shrink only
            steps.append((v, sorted(self.members[v.job_id])))
            taken += len(self.members[v.job_id]) * v.spec.nproc_per_node if cross(v) else 0
            if self._fits_after(waiter, steps):
                self._commit_reclaim(waiter, self._minimal(waiter, steps))
                return

    def _fits_after(self, waiter: JobRecord, steps: list[tuple[JobRecord, list[str]]]) -> bool:
        """Whether the job's gang fits once the nodes of ``steps`` are released."""
        free = dict(self.free)
        released: dict[str, set[str]] = {}
        for v, nodes in steps:
            for node_id in set(nodes) - released.get(v.job_id, set()):
                free[node_id] = free.get(node_id, 0) + v.spec.nproc_per_node
            released.setdefault(v.job_id, set()).update(nodes)
        placed = [
            {n: a for n, a in per_node.items() if n not in released.get(job_id, ())}
            for job_id, per_node in self.members.items()
        ]
        need = waiter.spec.min_nodes - len(self.members[waiter.job_id])
        limit = self._queue(waiter).limit
        if limit is not None:  # the waiter's queue's limit, once its own victims shrank
            given_back = sum(len(nodes) * self.view.jobs[j].spec.nproc_per_node
                             for j, nodes in released.items()
                             if self.view.jobs[j].spec.queue == waiter.spec.queue)
            held = self.used.get(waiter.spec.queue, 0) - given_back
            if held + self._claimed(waiter.spec.queue) + need * waiter.spec.nproc_per_node > limit:
                return False
        return sum(1 for n in free if self._fits(waiter, n, free, placed)) >= need

    def _hold_room(self, waiter: JobRecord, steps: list[tuple[JobRecord, list[str]]]) -> None:
        """Hold the nodes the waiter will start on (freed by ``steps``, or free now)
        for it: nobody else is placed on them in this pass."""
        free = dict(self.free)
        released: set[str] = set()
        for v, nodes in steps:
            for node_id in set(nodes):
                free[node_id] = free.get(node_id, 0) + v.spec.nproc_per_node
            released.update(nodes)
        gone: dict[str, set[str]] = {}
        for v, nodes in steps:
            gone.setdefault(v.job_id, set()).update(nodes)
        placed = [{n: a for n, a in per_node.items() if n not in gone.get(job_id, ())}
                  for job_id, per_node in self.members.items()]
        need = waiter.spec.min_nodes - len(self.members[waiter.job_id])
        usable = sorted((n for n in free if self._fits(waiter, n, free, placed)),
                        key=lambda n: (n not in released, -free[n], n))
        for node_id in usable[:need]:
            self.held[node_id] = waiter.job_id

    def _minimal(
        self, waiter: JobRecord, steps: list[tuple[JobRecord, list[str]]]
    ) -> list[tuple[JobRecord, list[str]]]:
        """``steps`` without those the job fits without (latest kept: it made it fit)."""
        kept = list(steps)
        for i in range(len(kept) - 2, -1, -1):
            trial = kept[:i] + kept[i + 1:]
            if self._fits_after(waiter, trial):
                kept = trial
        return kept

    def _commit_reclaim(
        self, waiter: JobRecord, steps: list[tuple[JobRecord, list[str]]]
    ) -> None:
        released: dict[str, set[str]] = {}
        for v, nodes in steps:
            released.setdefault(v.job_id, set()).update(nodes)
        self._hold_room(waiter, steps)
        spec = waiter.spec
        self.claims[waiter.job_id] = (
            (spec.min_nodes - len(self.members[waiter.job_id])) * spec.nproc_per_node)
        queue = waiter.spec.queue
        for job_id, release in sorted(released.items()):
            nodes = sorted(release)
            v = self.view.jobs[job_id]
            kept = self.members[job_id]
            before = len(kept)
            for node_id in nodes:
                del kept[node_id]  # its slots stay taken: they are held for the waiter
            self._hold(v, -len(nodes))
            change = self.change(job_id)
            change.delete.extend(sorted(nodes))
            change.reclaimed_for = waiter.job_id
            if v.spec.queue != queue:
                why = (f"for job {waiter.job_id} of queue {queue}, which is below its "
                       f"guarantee of {self._queue(waiter).guaranteed} slot(s)")
            else:
                why = (f"for job {waiter.job_id} of the same queue, of higher priority "
                       f"({waiter.spec.priority} > {v.spec.priority})")
            preempted = len(kept) < v.spec.min_nodes
            self.shrunk.add(job_id)
            self.reclaims.append(Reclaim(job_id, waiter.job_id, tuple(sorted(nodes)), preempted,
                                         v.spec.queue != queue))
            if preempted:
                self.preempted.add(job_id)
                rest = sorted(kept)
                change.delete.extend(rest)
                self._hold(v, -len(rest))
                for node_id in rest:  # not needed by the waiter: free for others
                    self._adjust(node_id, v.spec.nproc_per_node)
                kept.clear()
                self.count_restart(job_id, EventReason.PREEMPTED)
                self.set_phase(job_id, JobPhase.PENDING, EventReason.PREEMPTED,
                               f"preempted {why}; it resumes from its checkpoint when "
                               f"slots are free")
            else:
                self.count_restart(job_id, EventReason.RECLAIMED)
                self.event(job_id, EventReason.RECLAIMED,
                           f"shrunk from {before} to {len(kept)} node(s), releasing "
                           f"{names(nodes)}, {why}", sorted(nodes))


    def _fits(
        self, record: JobRecord, node_id: str, free: Mapping[str, int] | None = None,
        placed: Iterable[Mapping[str, Assignment]] | None = None,
    ) -> bool:
        """Whether ``record``'s job may get a node on ``node_id`` (given ``free`` slots
        and the jobs' ``placed`` assignments, for a reclaim's what-if)."""
        free = self.free if free is None else free
        placed = self.members.values() if placed is None else placed
        info = self.view.nodes[node_id]
        selector = record.spec.node_selector
        return (
            node_id in free
            and free[node_id] >= record.spec.nproc_per_node
            and node_id not in self.members[record.job_id]
            # A node whose runner just left this job is live and has free slots
            # again, but giving it back in this pass would put and delete the same
            # key in one transaction, which etcd refuses ("duplicate key given in
            # txn request"), failing every pass from then on. The next pass, when
            # the report belongs to no assignment, may assign it again.
            and node_id not in self.left.get(record.job_id, ())
            and all(info.labels.get(k) == v for k, v in selector.items())
            # GPUs: healthy ones no job placed here asks for (rendezvous.gpus).
            and (record.spec.gpus_per_node == 0 or gpus_free(
                info, node_id, placed) >= record.spec.gpus_per_node)
        )

    def _grow(
        self, record: JobRecord, *, to_min_only: bool, most: int | None = None,
        borrowing: bool = False,
    ) -> int:
        """Place the job toward its minimum (all of it or nothing) or its maximum.

        Args:
            most: place at most this many nodes (growth only).
            borrowing: the placement goes beyond the queue's guarantee: it
                stays off nodes reserved for another job.

        Returns:
            How many nodes were placed.
        """
        job_id = record.job_id
        kept = self.members[job_id]
        spec = record.spec
        target = spec.min_nodes if to_min_only else spec.max_nodes
        want = target - len(kept)
        if not to_min_only and most is not None:
            want = min(want, most)
        # The queue's limit, in nodes of this job: all of a gang or nothing.
        room = self._limit_room(record) // spec.nproc_per_node
        if to_min_only and room < want:
            return 0
        want = min(want, room)
        if want <= 0:
            return 0
        if not to_min_only and len(kept) < spec.min_nodes:
            # The gang step could not give this job its minimum; growth must not
            # give it part of it either (it would hold nodes while PENDING).
            return 0
        if not any(free >= spec.nproc_per_node for free in self.open.values()):
            return 0  # nothing fits anywhere: skip the scan (2,000 pending jobs on a full cluster)
        candidates = sorted(
            (n for n in self.open if self._fits(record, n)
             and self.held.get(n, job_id) == job_id
             and not (borrowing and self._reserved_away(n, record))),
            key=lambda n: (-self.free[n], n),
        )
        if to_min_only and len(candidates) < want:
            return 0  # gang: all of the minimum or nothing
        chosen = candidates[:want]
        if not chosen:
            return 0
        self._hold(record, len(chosen))
        for node_id in chosen:
            kept[node_id] = self.new_assignment(job_id)
            self.change(job_id).put[node_id] = kept[node_id]
            self._adjust(node_id, -spec.nproc_per_node)
        if to_min_only:
            self.gangs[job_id] = (sorted(chosen), len(kept))
            for node_id in [n for n, held in self.reserved.items() if held[0] == job_id]:
                del self.reserved[node_id]  # it got its nodes
        else:
            self.grown.setdefault(job_id, []).extend(chosen)
        return len(chosen)

    def _announce(self, record: JobRecord) -> None:
        """One event for the job's gang start and one for its growth in this pass."""
        job_id = record.job_id
        gang = self.gangs.pop(job_id, None)
        grown = self.grown.pop(job_id, [])
        if gang is not None:
            chosen, members = gang
            if record.started_at is None:
                self.change(job_id).record.started_at = self.now
                placed = sorted(set(self.members[job_id]) - set(grown))
                self.event(job_id, EventReason.SCHEDULED, f"scheduled on {names(placed)}",
                           placed, members=members)
            else:
                self.count_restart(job_id, EventReason.NODE_JOINED)
                self.event(job_id, EventReason.NODE_JOINED, f"node(s) {names(chosen)} joined",
                           chosen, members=members)
        if grown:
            # Growth in the very pass that starts the job (gang, then toward the
            # maximum) is written in the same transaction: nothing restarts.
            if record.started_at is not None:
                self.count_restart(job_id, EventReason.NODE_JOINED)
            self.event(job_id, EventReason.NODE_JOINED, f"node(s) {names(grown)} joined",
                       sorted(grown))

    def _settle_phase(self, record: JobRecord) -> None:
        job_id = record.job_id
        kept = self.members[job_id]
        placed = {n: a.generation for n, a in kept.items()}
        if record.nodes != placed:
            self.change(job_id).record.nodes = placed
        spec = record.spec
        # New bounds written in place change no membership: the job stays as it is.
        changed = job_id in self.changes and bool(
            self.changes[job_id].put.keys() - self.rebounded.get(job_id, set())
            or self.changes[job_id].delete
        )
        current = self.changes[job_id].record if job_id in self.changes else record
        if len(kept) < spec.min_nodes:
            message = f"{len(kept)} of at least {spec.min_nodes} node(s) available"
            reason = EventReason.BELOW_MIN_NODES
            if job_id in self.preempted or any(
                c.type == "Scheduled" and not c.status and c.reason == EventReason.PREEMPTED
                for c in current.conditions
            ):
                reason = EventReason.PREEMPTED
                message = f"preempted; {message}"
            if current.phase != JobPhase.PENDING:
                self.set_phase(job_id, JobPhase.PENDING, reason, message)
            self._condition(job_id, "Scheduled", False, reason, message)
            self._condition(job_id, "Running", False, reason, message)
            self._condition(job_id, "Training", False, reason, message)
            return
        nodes = names(kept)
        self._condition(job_id, "Scheduled", True, EventReason.SCHEDULED, f"on {nodes}")
        reports = current_statuses(kept, self.view.statuses.get(job_id, {}))
        self._training(job_id, reports, world=len(kept) * spec.nproc_per_node, changed=changed)
        world = len(kept) * spec.nproc_per_node
        settled = len(reports) == len(kept) and all(
            st.state == JobNodeState.RUNNING and st.world_size == world for st in reports.values()
        )
        if settled and not changed:
            # The phase's event says the path only when it was live: a restart
            # is what the job did before the live path existed.
            how = EventReason.RESIZED_LIVE if resized_live(reports) else EventReason.RESTARTED
            self.set_phase(job_id, JobPhase.RUNNING, how, f"running at world size {world}")
            self._condition(job_id, "Running", True, EventReason.RESTARTED,
                            f"world size {world} on {nodes}")
            return
        if changed or current.phase == JobPhase.PENDING:
            if current.phase != JobPhase.PENDING and record.started_at is not None:
                # Its nodes may resize live or restart (agent.live): not known yet.
                self.set_phase(job_id, JobPhase.RESCALING, EventReason.RESIZING,
                               f"resizing to {len(kept)} node(s)")
            elif record.started_at is not None:  # it waited: a restart from checkpoint
                self.set_phase(job_id, JobPhase.RESCALING, EventReason.RESTARTED,
                               f"restarting on {len(kept)} node(s) from the latest checkpoint")
            else:
                self.set_phase(job_id, JobPhase.RUNNING, EventReason.SCHEDULED,
                               f"starting on {nodes}")
        self._condition(job_id, "Running", False, EventReason.RESTARTED,
                        f"waiting for {len(kept)} node(s) to run at world size {world}")

    def _training(
        self, job_id: str, reports: dict[str, JobNodeStatus], *, world: int, changed: bool
    ) -> None:
        """``Training``: true once a worker of the current generation and size reported a step."""
        stepped = {
            node: st.last_step for node, st in reports.items()
            if st.state == JobNodeState.RUNNING and st.world_size == world
            and st.last_step is not None
        }
        if stepped and not changed:
            node = max(stepped, key=lambda n: (stepped[n] or 0, n))
            if self.view.jobs[job_id].first_step_at is None:
                self.change(job_id).record.first_step_at = self.now
            self._condition(job_id, "Training", True, EventReason.TRAINING_STARTED,
                            f"step {stepped[node]} reported by {node}")
        else:
            self._condition(job_id, "Training", False, EventReason.WAITING_FOR_FIRST_STEP,
                            "no worker of the current generation has reported a step yet")

    def _condition(
        self, job_id: str, type_: ConditionType, status: bool, reason: EventReason, message: str
    ) -> None:
        record = self.changes[job_id].record if job_id in self.changes else self.view.jobs[job_id]
        # Checked before change(): most passes change nothing for most jobs,
        # and change() deep-copies the record.
        if record.condition_differs(type_, status, reason.value):
            self.change(job_id).record.set_condition(
                type_, status, reason.value, message, now=self.now
            )


def plan(view: ClusterView, now: datetime, policy: Policy = Policy()) -> list[JobChange]:
    """Decide what to change so that assignments match the jobs and the live nodes.

    Args:
        view: jobs, live nodes, drains, assignments, agent reports and queues.
        now: the time stamped on events and records (and the clock of reservations).
        policy: the scheduler's tunables.

    Returns:
        One :class:`JobChange` per job that needs a write, highest priority first.
    """
    return decide(view, now, policy).changes


def decide(view: ClusterView, now: datetime, policy: Policy = Policy()) -> Decision:
    """:func:`plan`, with the reservations and reclaims it made on the way."""
    planner = _Planner(view, now, policy)
    changes = planner.run()
    return Decision(changes, planner.reservations, planner.reclaims)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + "..."


def failure_message(status: JobNodeStatus) -> str:
    """The event of a job that failed because of ``status``'s node.

    A runner's failure (it could not start the job, raised or was killed) is
    quoted as its message: it names the cause, which an exit code would not.
    """
    error = status.error
    if error is not None and error.rank == RUNNER_RANK and error.message:
        return f"the job failed on {status.node_id}: {_clip(error.message)}"
    detail = f": exit code {error.exit_code}" if error is not None else ""
    return f"a worker failed on {status.node_id} and the restart budget is spent{detail}"


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
    planner = _Planner(view, now)
    change = planner.change(job_id)
    message = (f"etcd refused the job's change ({attempt} of {limit} tries before the job "
               f"fails): {_clip(error)}")
    change.record.set_condition("Scheduled", False, EventReason.WRITE_FAILED.value, message,
                                now=now)
    planner.event(job_id, EventReason.WRITE_FAILED, message)
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
    planner = _Planner(view, now)
    change = planner.change(job_id)
    change.delete = sorted(view.assignments.get(job_id, {}))
    record = change.record
    if record.phase.is_terminal():
        return change
    message = f"etcd refused the job's writes; it cannot be scheduled: {_clip(error)}"
    reason = EventReason.WRITE_FAILED.value
    planner.members[job_id] = {}
    record.nodes = {}
    record.exit_reason = ExitReason.UNSCHEDULABLE
    off: tuple[ConditionType, ...] = ("Scheduled", "Running", "Training")
    for type_ in off:
        record.set_condition(type_, False, reason, message, now=now)
    record.set_condition("Finished", True, reason, message, now=now)
    planner.set_phase(job_id, JobPhase.FAILED, EventReason.WRITE_FAILED, message)
    return change
