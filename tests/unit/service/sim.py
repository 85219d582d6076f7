"""A cluster driven only through :func:`service.scheduler.plan`, for the scheduler's tests.

:func:`apply` writes a plan into a :class:`ClusterView` the way the reconcile
loop writes it into etcd (one transaction per :class:`JobChange`), and refuses
what etcd would refuse. :class:`Sim` keeps a view and plays everyone else: the
agents (reporting a state for their assignment's generation), the nodes
(dying, joining, draining), and the API (submit, PATCH, cancel), so that tests
can run successive reconcile passes without etcd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

from rendezvous.records import Assignment, JobNodeState, JobNodeStatus, WorkerError
from rendezvous.registry import NodeInfo
from service.api.models import EventReason, JobEvent, JobPhase, JobRecord, JobSpec
from service.api.queues import QueueSpec
from service.scheduler import ClusterView, Decision, JobChange, Policy, decide

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def make_node(
    node_id: str, *, slots: int = 1, labels: dict[str, str] | None = None
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, host="host", slots=slots, labels=labels or {}, started_at=T0,
        version="test",
    )


def make_job(
    job_id: str,
    *,
    min_nodes: int = 1,
    max_nodes: int = 1,
    nproc: int = 1,
    priority: int = 0,
    created: int = 0,
    selector: dict[str, str] | None = None,
    queue: str = "default",
) -> JobRecord:
    """A job as ``POST /v1/jobs`` stores it; ``created`` is seconds after :data:`T0`."""
    spec = JobSpec(
        name=job_id, command=["python", "train.py"], min_nodes=min_nodes, max_nodes=max_nodes,
        nproc_per_node=nproc, priority=priority, node_selector=selector or {}, queue=queue,
    )
    # The API writes the "submitted" event as seq 0.
    return JobRecord(
        job_id=job_id, spec=spec, created_at=T0 + timedelta(seconds=created), next_event=1
    )


def apply(view: ClusterView, changes: list[JobChange]) -> ClusterView:
    """The view after the reconcile loop wrote ``changes``, one transaction each.

    Raises:
        AssertionError: a change that etcd would refuse: one transaction that
            puts and deletes the same key ("duplicate key given in txn request"),
            or a record for a job that does not exist.
    """
    jobs = dict(view.jobs)
    assignments = {job: dict(per_node) for job, per_node in view.assignments.items()}
    slow = dict(view.slow)
    for change in changes:
        assert change.job_id in jobs, f"a change for unknown job {change.job_id}"
        assert change.record.job_id == change.job_id
        both = set(change.put) & set(change.delete)
        assert not both, (
            f"job {change.job_id}: one transaction puts and deletes the assignment on "
            f"{sorted(both)}; etcd refuses it (duplicate key given in txn request)"
        )
        jobs[change.job_id] = change.record
        per_node = assignments.setdefault(change.job_id, {})
        for node_id in change.delete:
            per_node.pop(node_id, None)
        per_node.update(change.put)
        if not per_node:
            del assignments[change.job_id]
        slow.update(change.slow)  # a straggler's mark, in the same transaction
    return replace(view, jobs=jobs, assignments=assignments, slow=slow)


@dataclass
class Sim:
    """A cluster whose only coordinator is :func:`plan`."""

    view: ClusterView = field(default_factory=lambda: ClusterView(jobs={}, nodes={}))
    clock: datetime = T0 + timedelta(minutes=1)
    events: dict[str, list[JobEvent]] = field(default_factory=dict)
    history: list[list[JobChange]] = field(default_factory=list)
    policy: Policy = field(default_factory=Policy)
    last: Decision | None = None  # the last pass's decision (reservations, reclaims)

    # the coordinator -----------------------------------------------------------------

    def plan(self) -> list[JobChange]:
        return decide(self.view, self.clock, self.policy).changes

    def step(self) -> list[JobChange]:
        """One reconcile pass: plan on the current view and write the plan."""
        self.last = decide(self.view, self.clock, self.policy)
        changes = self.last.changes
        self.view = apply(self.view, changes)
        for change in changes:
            self.events.setdefault(change.job_id, []).extend(change.events)
        self.history.append(changes)
        self.clock += timedelta(seconds=1)
        return changes

    def settle(self, *, max_passes: int = 10) -> int:
        """Pass and let every agent report running until a pass changes nothing.

        Returns:
            How many passes wrote something.
        """
        for passes in range(max_passes):
            self.report_running()
            if not self.step():
                return passes
        raise AssertionError(f"no fixed point after {max_passes} passes: {self.history[-1]}")

    # the API -------------------------------------------------------------------------

    def submit(self, record: JobRecord) -> None:
        self.events[record.job_id] = [
            JobEvent(seq=0, time=self.clock, phase=JobPhase.PENDING,
                     reason=EventReason.SUBMITTED, message="submitted")
        ]
        self._put_job(record)

    def cancel(self, job_id: str) -> None:
        self._put_job(self.job(job_id).model_copy(update={"cancel_requested": True}))

    def patch(self, job_id: str, *, min_nodes: int | None = None,
              max_nodes: int | None = None) -> None:
        """What ``PATCH /v1/jobs/{id}`` writes: new bounds and a scaled_by_user event."""
        record = self.job(job_id).model_copy(deep=True)
        bounds = {"min_nodes": min_nodes or record.spec.min_nodes,
                  "max_nodes": max_nodes or record.spec.max_nodes}
        record.spec = JobSpec.model_validate({**record.spec.model_dump(), **bounds})
        self.events[job_id].append(
            JobEvent(seq=record.next_event, time=self.clock, phase=record.phase,
                     reason=EventReason.SCALED_BY_USER, message="bounds set")
        )
        record.next_event += 1
        self._put_job(record)

    def set_queue(self, name: str, guaranteed: int = 0, *, limit: int | None = None,
                  weight: float = 1.0) -> None:
        """What ``POST`` or ``PATCH /v1/queues`` stores."""
        queue = QueueSpec(name=name, guaranteed=guaranteed, limit=limit, weight=weight,
                          created_at=T0)
        self.view = replace(self.view, queues={**self.view.queues, name: queue})

    def _put_job(self, record: JobRecord) -> None:
        self.view = replace(self.view, jobs={**self.view.jobs, record.job_id: record})

    # the nodes -----------------------------------------------------------------------

    def join(self, *nodes: NodeInfo) -> None:
        self.view = replace(
            self.view, nodes={**self.view.nodes, **{n.node_id: n for n in nodes}}
        )

    def kill(self, *node_ids: str) -> None:
        """The nodes' leases expire: their records go (assignments and reports stay)."""
        self.view = replace(
            self.view, nodes={k: v for k, v in self.view.nodes.items() if k not in node_ids}
        )

    def drain(self, *node_ids: str) -> None:
        self.view = replace(self.view, draining=self.view.draining | frozenset(node_ids))

    def undrain(self, *node_ids: str) -> None:
        """What ``tidal undrain`` does: the drain goes, and the node's slow mark."""
        self.view = replace(self.view, draining=self.view.draining - frozenset(node_ids),
                            slow={n: m for n, m in self.view.slow.items() if n not in node_ids})

    # the agents ----------------------------------------------------------------------

    def report(
        self,
        job_id: str,
        node_id: str,
        state: JobNodeState = JobNodeState.RUNNING,
        *,
        world_size: int | None = None,
        generation: int | None = None,
        error: WorkerError | None = None,
        at: int = 0,
        last_step: int | None = None,
        charged: int = 0,
        remaining_restarts: int = 0,
        last_resize: str | None = None,
        paces: list[tuple[int, float]] | None = None,
    ) -> None:
        """``node_id``'s agent reports ``state`` for its assignment of ``job_id``.

        Unless given, the generation is the assignment's and the world size the
        job's current one (assigned nodes times processes per node). ``charged``:
        the restarts the agent charged to the node's budget in this generation;
        ``last_resize``: the path its last membership change took (agent.runner.live_decide);
        ``paces``: its slowest rank's pace per recent step (agent.progress.node_paces).
        """
        if generation is None:
            generation = self.view.assignments[job_id][node_id].generation
        if world_size is None:
            world_size = len(self.placed(job_id)) * self.job(job_id).spec.nproc_per_node
        status = JobNodeStatus(
            job_id=job_id, node_id=node_id, generation=generation, state=state,
            world_size=world_size, error=error, updated_at=self.clock + timedelta(seconds=at),
            last_step=last_step, remaining_restarts=remaining_restarts,
            restart_count=charged,
            restart_reasons={"worker_failed": charged} if charged else {},
            last_resize=last_resize, paces=paces or [],
        )
        statuses = {job: dict(per_node) for job, per_node in self.view.statuses.items()}
        statuses.setdefault(job_id, {})[node_id] = status
        self.view = replace(self.view, statuses=statuses)

    def report_running(self) -> None:
        """Every assigned node's agent runs its job at the job's current world size."""
        for job_id, per_node in sorted(self.view.assignments.items()):
            for node_id in sorted(per_node):
                self.report(job_id, node_id)

    # reading -------------------------------------------------------------------------

    def job(self, job_id: str) -> JobRecord:
        return self.view.jobs[job_id]

    def phase(self, job_id: str) -> JobPhase:
        return self.job(job_id).phase

    def placed(self, job_id: str) -> set[str]:
        return set(self.view.assignments.get(job_id, {}))

    def assignment(self, job_id: str, node_id: str) -> Assignment:
        return self.view.assignments[job_id][node_id]

    def reasons(self, job_id: str) -> list[EventReason]:
        return [e.reason for e in self.events.get(job_id, [])]

    def used(self, node_id: str) -> int:
        return sum(
            per_node[node_id].nproc_per_node
            for per_node in self.view.assignments.values() if node_id in per_node
        )


# a day of work -------------------------------------------------------------------------


@dataclass
class Work:
    """A job of a workload: when it is submitted and how much it has to do.

    ``work`` is in slot-seconds: a job holding ``s`` slots advances ``s`` per
    second, except for ``restart_s`` after each change of its membership (a
    graceful resize or a restart from its checkpoint loses no step, only time).
    """

    record: JobRecord
    submit_at: float  # seconds after the workload's start
    work: float
    done: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    paused_until: float = 0.0
    nodes: frozenset[str] = frozenset()


@dataclass
class DayStats:
    """What a workload run measured."""

    seconds: float
    slot_seconds: float  # capacity over the run
    busy_slot_seconds: float  # slots assigned to jobs
    # queue -> seconds it held less than its guarantee while a waiting job of it
    # fitted in the difference, beyond one pass
    short_of_guarantee_s: dict[str, float]
    waits: dict[str, list[float]]  # queue -> submit to first start, per started job
    finished: int
    preemptions: int
    shrinks: int

    @property
    def utilisation(self) -> float:
        return self.busy_slot_seconds / self.slot_seconds if self.slot_seconds else 0.0


class Workload:
    """Drive a :class:`Sim` through submissions, progress and completions, a pass
    every ``dt`` seconds: the agents report running (or success once a job's
    work is done), then the coordinator passes.

    Finished jobs leave the view (the real store keeps them; the scheduler only
    skips them), so that a day of them keeps each pass small.
    """

    def __init__(self, sim: Sim, works: list[Work], *, dt: float = 10.0,
                 restart_s: float = 20.0) -> None:
        self.sim = sim
        self.pending = sorted(works, key=lambda w: w.submit_at)
        self.works = {w.record.job_id: w for w in works}
        self.dt = dt
        self.restart_s = restart_s
        self.t = 0.0
        self.starts: dict[str, float] = {}
        self.short: set[str] = set()  # queues short of their guarantee at the last pass

    def run(self, seconds: float, *, on_pass: Callable[[Workload], None] | None = None
            ) -> DayStats:
        sim = self.sim
        capacity = sum(n.slots for n in sim.view.nodes.values())
        stats = DayStats(seconds, 0.0, 0.0, {}, {}, 0, 0, 0)
        while self.t < seconds:
            while self.pending and self.pending[0].submit_at <= self.t:
                work = self.pending.pop(0)
                sim.submit(work.record.model_copy(
                    update={"created_at": sim.clock, "next_event": 1}))
            self._progress(stats)
            for change in sim.step():
                for event in change.events:
                    if event.reason == EventReason.PREEMPTED:
                        stats.preemptions += 1
                    elif event.reason == EventReason.RECLAIMED:
                        stats.shrinks += 1
            sim.clock += timedelta(seconds=self.dt - 1)  # step() advanced one second
            used = self._used()
            stats.slot_seconds += capacity * self.dt
            stats.busy_slot_seconds += sum(used.values()) * self.dt
            self._guarantees(used, stats)
            if on_pass is not None:
                on_pass(self)
            self.t += self.dt
        for job_id, start in self.starts.items():
            work = self.works[job_id]
            stats.waits.setdefault(work.record.spec.queue, []).append(start - work.submit_at)
        stats.finished = sum(1 for w in self.works.values() if w.finished_at is not None)
        return stats

    def _used(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for job_id, per_node in self.sim.view.assignments.items():
            queue = self.sim.view.jobs[job_id].spec.queue
            used[queue] = used.get(queue, 0) + sum(a.nproc_per_node for a in per_node.values())
        return used

    def _guarantees(self, used: dict[str, int], stats: DayStats) -> None:
        """Count the time a queue held less than its guarantee while one of its
        waiting jobs would have fitted in the difference, beyond the one pass a
        reclaim takes."""
        view = self.sim.view
        short_now: set[str] = set()
        for job_id, record in view.jobs.items():
            spec = record.spec
            queue = view.queues.get(spec.queue)
            if (queue is None or record.phase.is_terminal()
                    or len(view.assignments.get(job_id, {})) >= spec.min_nodes):
                continue
            if used.get(spec.queue, 0) + spec.min_nodes * spec.nproc_per_node <= (
                    queue.guaranteed):
                short_now.add(spec.queue)
        for name in short_now & self.short:
            stats.short_of_guarantee_s[name] = stats.short_of_guarantee_s.get(name, 0.0) + self.dt
        self.short = short_now

    def _progress(self, stats: DayStats) -> None:
        """Advance every placed job by the last ``dt``; report success or running."""
        sim = self.sim
        finished: list[str] = []
        for job_id, per_node in sorted(sim.view.assignments.items()):
            work = self.works[job_id]
            record = sim.job(job_id)
            nodes = frozenset(per_node)
            if nodes != work.nodes:
                work.nodes = nodes
                work.paused_until = self.t + self.restart_s
            if len(nodes) >= record.spec.min_nodes:
                self.starts.setdefault(job_id, self.t)
                running = max(0.0, self.t - max(work.paused_until, self.t - self.dt))
                work.done += running * len(nodes) * record.spec.nproc_per_node
            state = JobNodeState.SUCCEEDED if work.done >= work.work else JobNodeState.RUNNING
            if state == JobNodeState.SUCCEEDED and work.finished_at is None:
                work.finished_at = self.t
            for node_id in sorted(per_node):
                sim.report(job_id, node_id, state)
        for job_id, record in sim.view.jobs.items():
            if record.phase.is_terminal():
                finished.append(job_id)
        if finished:
            gone = set(finished)
            sim.view = replace(
                sim.view,
                jobs={j: r for j, r in sim.view.jobs.items() if j not in gone},
                statuses={j: s for j, s in sim.view.statuses.items() if j not in gone},
            )
