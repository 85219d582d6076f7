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
* when the user changed min/max, the job's remaining assignments are
  rewritten with the new bounds (a graceful restart from the checkpoint) and
  nodes beyond the new maximum are released, the newest first;
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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from rendezvous.gpus import gpus_free
from rendezvous.records import RUNNER_RANK, Assignment, JobNodeState, JobNodeStatus
from rendezvous.registry import NodeInfo
from service.models import (
    ChargedRestarts,
    ConditionType,
    EventReason,
    ExitReason,
    JobEvent,
    JobPhase,
    JobRecord,
)


@dataclass(frozen=True)
class ClusterView:
    """Everything the scheduler decides on. Build it from etcd (or by hand in tests)."""

    jobs: dict[str, JobRecord]
    nodes: dict[str, NodeInfo]
    draining: frozenset[str] = frozenset()
    assignments: dict[str, dict[str, Assignment]] = field(default_factory=dict)  # job -> node ->
    statuses: dict[str, dict[str, JobNodeStatus]] = field(default_factory=dict)  # job -> node ->


@dataclass
class JobChange:
    """What to write for one job, in one transaction."""

    job_id: str
    record: JobRecord  # the record to write (compared against its mod revision)
    put: dict[str, Assignment] = field(default_factory=dict)  # node -> new assignment
    delete: list[str] = field(default_factory=list)  # nodes whose assignment goes
    events: list[JobEvent] = field(default_factory=list)

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


def statuses_in_force(
    generations: Mapping[str, int], statuses: dict[str, JobNodeStatus]
) -> dict[str, JobNodeStatus]:
    """The reports of the assignments in force: same node, same generation.

    Args:
        generations: node -> generation of the job's assignment there.
        statuses: node -> what that node's agent reported for the job.
    """
    return {
        node: st for node, st in statuses.items() if generations.get(node) == st.generation
    }


def current_statuses(
    assigned: dict[str, Assignment], statuses: dict[str, JobNodeStatus]
) -> dict[str, JobNodeStatus]:
    """:func:`statuses_in_force` for a node -> :class:`Assignment` map."""
    return statuses_in_force({n: a.generation for n, a in assigned.items()}, statuses)


#: The restart reason whose restarts the agents charge to a node's budget.
CHARGED_REASON = "worker_failed"


@dataclass(frozen=True)
class Charge:
    """A rise of one node's charged restart count that the job's record has not counted."""

    node_id: str
    before: int  # what the record had counted of this node's generation
    status: JobNodeStatus  # the report now: ``restart_reasons[CHARGED_REASON]`` above ``before``

    @property
    def count(self) -> int:
        return self.status.restart_reasons.get(CHARGED_REASON, 0)

    @property
    def restarts(self) -> int:
        """The restarts of the rise that restarted the node's workers (the last
        charge of a node whose budget is spent ended it instead)."""
        rise = self.count - self.before
        return rise - 1 if self.status.state == JobNodeState.FAILED else rise


def restart_charges(
    charged: Mapping[str, ChargedRestarts],
    generations: Mapping[str, int],
    statuses: Mapping[str, JobNodeStatus],
) -> tuple[dict[str, ChargedRestarts], list[Charge]]:
    """Fold the charged restarts the nodes report into what a job's record counted.

    An agent counts a node's charged restarts per assignment generation: a node
    that leaves and rejoins starts again from 0. The record keeps, per node, the
    generation and the count it has already added to the job's ``restarts``; a
    report of that generation adds only its rise, one of a new generation all of
    its count. Entries of nodes no longer assigned at that generation are dropped.

    Args:
        charged: the record's ``charged``.
        generations: node -> generation of the job's assignment there (in force).
        statuses: node -> what that node's agent reported for the job.

    Returns:
        The new ``charged``, and the rises not yet counted (sorted by node).
    """
    folded = {
        node: seen for node, seen in charged.items() if generations.get(node) == seen.generation
    }
    rises: list[Charge] = []
    for node, st in sorted(statuses_in_force(generations, dict(statuses)).items()):
        count = st.restart_reasons.get(CHARGED_REASON, 0)
        seen = folded.get(node)
        before = seen.worker_failed if seen is not None else 0
        if count > before:
            rises.append(Charge(node, before, st))
            folded[node] = ChargedRestarts(generation=st.generation, worker_failed=count)
    return folded, rises


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


class _Planner:
    def __init__(self, view: ClusterView, now: datetime) -> None:
        self.view = view
        self.now = now
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
        record = self.change(job_id).record
        if record.phase == phase:
            return
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
            if self._finish_if_done(record, assigned):
                continue
            self._keep_usable(record, assigned)
            active.append(record)
        for record in active:
            self._rebound(record)
        # Gang start: jobs below their minimum first, then growth toward maximum.
        for record in active:
            self._grow(record, to_min_only=True)
        for record in active:
            self._grow(record, to_min_only=False)
        for record in active:
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
        """Apply the user's min/max: release the surplus, restart the rest with new bounds."""
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
            kept[node_id] = self.new_assignment(job_id)
            self.change(job_id).put[node_id] = kept[node_id]
        if released or stale:
            self.count_restart(job_id, EventReason.SCALED_BY_USER)
            self.event(
                job_id, EventReason.SCALED_BY_USER,
                f"bounds now {spec.min_nodes}..{spec.max_nodes} nodes"
                + (f"; released {names(released)}" if released else ""),
                released,
            )

    def _fits(self, record: JobRecord, node_id: str) -> bool:
        info = self.view.nodes[node_id]
        selector = record.spec.node_selector
        return (
            node_id in self.free
            and self.free[node_id] >= record.spec.nproc_per_node
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
                info, node_id, self.members.values()) >= record.spec.gpus_per_node)
        )

    def _grow(self, record: JobRecord, *, to_min_only: bool) -> None:
        job_id = record.job_id
        kept = self.members[job_id]
        spec = record.spec
        target = spec.min_nodes if to_min_only else spec.max_nodes
        want = target - len(kept)
        if want <= 0:
            return
        if not to_min_only and len(kept) < spec.min_nodes:
            # The gang step could not give this job its minimum; growth must not
            # give it part of it either (it would hold nodes while PENDING).
            return
        if not any(free >= spec.nproc_per_node for free in self.open.values()):
            return  # nothing fits anywhere: skip the scan (2,000 pending jobs on a full cluster)
        candidates = sorted(
            (n for n in self.open if self._fits(record, n)),
            key=lambda n: (-self.free[n], n),
        )
        if to_min_only and len(candidates) < want:
            return  # gang: all of the minimum or nothing
        chosen = candidates[:want]
        if not chosen:
            return
        for node_id in chosen:
            kept[node_id] = self.new_assignment(job_id)
            self.change(job_id).put[node_id] = kept[node_id]
            self._adjust(node_id, -spec.nproc_per_node)
        first_start = record.started_at is None and self.change(job_id).record.started_at is None
        if first_start:
            self.change(job_id).record.started_at = self.now
            self.event(job_id, EventReason.SCHEDULED, f"scheduled on {names(kept)}", sorted(kept))
        else:
            # Growth in the very pass that starts the job (gang, then toward the
            # maximum) is written in the same transaction: nothing restarts.
            if record.started_at is not None:
                self.count_restart(job_id, EventReason.NODE_JOINED)
            self.event(job_id, EventReason.NODE_JOINED, f"node(s) {names(chosen)} joined", chosen)

    def _settle_phase(self, record: JobRecord) -> None:
        job_id = record.job_id
        kept = self.members[job_id]
        placed = {n: a.generation for n, a in kept.items()}
        if record.nodes != placed:
            self.change(job_id).record.nodes = placed
        spec = record.spec
        changed = job_id in self.changes and bool(
            self.changes[job_id].put or self.changes[job_id].delete
        )
        current = self.changes[job_id].record if job_id in self.changes else record
        if len(kept) < spec.min_nodes:
            message = f"{len(kept)} of at least {spec.min_nodes} node(s) available"
            if current.phase != JobPhase.PENDING:
                self.set_phase(job_id, JobPhase.PENDING, EventReason.BELOW_MIN_NODES, message)
            self._condition(job_id, "Scheduled", False, EventReason.BELOW_MIN_NODES, message)
            self._condition(job_id, "Running", False, EventReason.BELOW_MIN_NODES, message)
            self._condition(job_id, "Training", False, EventReason.BELOW_MIN_NODES, message)
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
            self.set_phase(job_id, JobPhase.RUNNING, EventReason.RESTARTED,
                           f"running at world size {world}")
            self._condition(job_id, "Running", True, EventReason.RESTARTED,
                            f"world size {world} on {nodes}")
            return
        if changed or current.phase == JobPhase.PENDING:
            if record.started_at is not None:  # it ran before: a restart from checkpoint
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


def plan(view: ClusterView, now: datetime) -> list[JobChange]:
    """Decide what to change so that assignments match the jobs and the live nodes.

    Args:
        view: jobs, live nodes, drains, assignments and agent reports.
        now: the time stamped on events and records.

    Returns:
        One :class:`JobChange` per job that needs a write, highest priority first.
    """
    return _Planner(view, now).run()


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
