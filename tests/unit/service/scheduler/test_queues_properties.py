"""Queues through random cluster histories: what the scheduler must hold after every pass.

A hypothesis state machine plays queues (guarantees, limits, weights), users
(submitting rigid and elastic jobs of any queue and priority, cancelling),
agents (reporting running, or success) and nodes (dying, joining), with a
reconcile pass as one more rule. Besides every invariant of
:mod:`tests.unit.service.scheduler.test_scheduler_properties` (no slot given twice among
them), after each pass:

* a job shrunk by a reclaim keeps at least its minimum; a preempted one holds
  nothing and is ``PENDING``;
* a job is never shrunk or preempted for another queue while it is within its
  own queue's guarantee (the slots its queue's jobs before it, in priority then
  submission order, leave of the guarantee), nor below that share;
* within a queue, only a job of lower priority gives way;
* no queue holds more than its limit after a pass that placed work in it;
* the room a reclaim makes is taken by its job in the very next pass
  (guarantees are honoured within one pass of room being made).

A second test plays a stream of small jobs around one big job and checks that
the big one starts within the reservation bound.
"""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from rendezvous.records import JobNodeState
from service.api.models import JobPhase, JobRecord
from service.scheduler import ClusterView, Decision, Policy
from service.scheduler.types import job_order as _order
from tests.unit.service.scheduler.test_scheduler_properties import check_pass
from tests.unit.service.sim import Sim, Work, Workload, make_job, make_node

QUEUE_NAMES = ["a", "b", "c"]


def share_before(view: ClusterView, after: ClusterView, victim: JobRecord) -> int:
    """The slots of the victim's queue's guarantee left for it by the jobs before it
    in its queue's order (their slots on nodes still live after the pass, before or
    after it, whichever is more: the pass may have lost, ended or started them)."""
    queue = view.queues.get(victim.spec.queue)
    guaranteed = queue.guaranteed if queue is not None else 0

    def held(v: ClusterView, job_id: str, nproc: int) -> int:
        return nproc * sum(1 for n in v.assignments.get(job_id, {}) if n in after.nodes)

    before = sum(
        max(held(view, j, r.spec.nproc_per_node) if not after.jobs[j].phase.is_terminal()
            else 0, held(after, j, r.spec.nproc_per_node))
        for j, r in view.jobs.items()
        if r.spec.queue == victim.spec.queue and _order(r) < _order(victim)
    )
    return max(0, guaranteed - before)


def check_reclaims(before: ClusterView, decision: Decision, after: ClusterView) -> None:
    for reclaim in decision.reclaims:
        victim = before.jobs[reclaim.victim]
        waiter = before.jobs[reclaim.waiter]
        spec = victim.spec
        held_before = len(before.assignments.get(reclaim.victim, {}))
        held_after = len(after.assignments.get(reclaim.victim, {}))
        if reclaim.preempted:
            assert held_after == 0 and after.jobs[reclaim.victim].phase == JobPhase.PENDING
        else:
            assert held_after >= spec.min_nodes, f"{reclaim.victim} shrunk below its minimum"
            assert held_after < held_before
        if reclaim.cross_queue:
            assert spec.queue != waiter.spec.queue
            share = share_before(before, after, victim)
            if reclaim.preempted:
                assert spec.min_nodes * spec.nproc_per_node > share, (
                    f"{reclaim.victim} preempted within its queue's guarantee ({share} slots)"
                )
            else:
                assert held_after * spec.nproc_per_node >= min(
                    share, held_before * spec.nproc_per_node), (
                    f"{reclaim.victim} shrunk into its queue's guarantee ({share} slots)"
                )
        else:
            assert spec.queue == waiter.spec.queue
            assert spec.priority < waiter.spec.priority, "a job gave way to an equal or lower one"


def check_limits(view: ClusterView, changes_jobs: set[str]) -> None:
    used: dict[str, int] = {}
    placed_in: set[str] = set()
    for job_id, per_node in view.assignments.items():
        queue = view.jobs[job_id].spec.queue
        used[queue] = used.get(queue, 0) + sum(a.nproc_per_node for a in per_node.values())
        if job_id in changes_jobs:
            placed_in.add(queue)
    for name in placed_in:
        queue = view.queues.get(name)
        if queue is not None and queue.limit is not None:
            assert used[name] <= queue.limit, f"queue {name} holds {used[name]} > {queue.limit}"


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(policy=Policy(reserve_after_s=30))
        self.generations: dict[str, set[int]] = {}
        self.jobs = 0
        self.nodes = 0

    @initialize(
        slots=st.lists(st.integers(1, 2), min_size=2, max_size=6),
        queues=st.lists(st.tuples(st.integers(0, 4), st.none() | st.integers(1, 6),
                                  st.sampled_from([0.5, 1.0, 3.0])),
                        min_size=len(QUEUE_NAMES), max_size=len(QUEUE_NAMES)),
        borrowers=st.lists(st.tuples(st.sampled_from(QUEUE_NAMES), st.integers(1, 2)),
                           min_size=2, max_size=4),
    )
    def a_cluster_of_teams_full_of_borrowers(
        self, slots: list[int], queues: list[tuple[int, int | None, float]],
        borrowers: list[tuple[str, int]],
    ) -> None:
        """Teams' queues, and elastic jobs that fill the idle cluster: the rules'
        submissions then make the scheduler reclaim."""
        for n in slots:
            self.add_node(n)
        for name, (guaranteed, extra, weight) in zip(QUEUE_NAMES, queues, strict=True):
            limit = None if extra is None else guaranteed + extra
            self.sim.set_queue(name, guaranteed, limit=limit, weight=weight)
        for queue, nproc in borrowers:
            self.submit(queue, 1, 5, nproc, -1)
        for _ in range(3):
            self.reconcile()

    @rule(slots=st.integers(1, 2))
    def add_node(self, slots: int) -> None:
        self.sim.join(make_node(f"n{self.nodes}", slots=slots))
        self.nodes += 1

    @precondition(lambda self: len(self.sim.view.nodes) > 1)
    @rule(i=st.integers(0, 30))
    def kill_node(self, i: int) -> None:
        live = sorted(self.sim.view.nodes)
        self.sim.kill(live[i % len(live)])

    @rule(queue=st.sampled_from([*QUEUE_NAMES, "default"]), min_nodes=st.integers(1, 3),
          extra=st.integers(0, 3), nproc=st.integers(1, 2), priority=st.integers(-1, 1))
    def submit(self, queue: str, min_nodes: int, extra: int, nproc: int, priority: int) -> None:
        self.jobs += 1
        self.sim.submit(make_job(
            f"j{self.jobs}", min_nodes=min_nodes, max_nodes=min_nodes + extra, nproc=nproc,
            priority=priority, created=60 + self.jobs, queue=queue,
        ))

    def _live(self) -> list[str]:
        return sorted(j for j, r in self.sim.view.jobs.items()
                      if not r.phase.is_terminal() and not r.cancel_requested)

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 30))
    def cancel(self, i: int) -> None:
        jobs = self._live()
        self.sim.cancel(jobs[i % len(jobs)])

    @precondition(lambda self: self.sim.view.assignments)
    @rule(i=st.integers(0, 30))
    def a_job_finishes(self, i: int) -> None:
        jobs = sorted(self.sim.view.assignments)
        job_id = jobs[i % len(jobs)]
        for node_id in sorted(self.sim.placed(job_id)):
            self.sim.report(job_id, node_id, JobNodeState.SUCCEEDED)

    @rule(seconds=st.integers(0, 40))
    def time_passes(self, seconds: int) -> None:
        self.sim.clock += timedelta(seconds=seconds)

    def _pass(self) -> Decision:
        before = self.sim.view
        changes = self.sim.step()
        assert self.sim.last is not None
        check_pass(before, changes, self.sim.view, self.generations)
        check_reclaims(before, self.sim.last, self.sim.view)
        check_limits(self.sim.view, {c.job_id for c in changes if c.put})
        return self.sim.last

    @rule()
    def reconcile(self) -> None:
        self.sim.report_running()
        decision = self._pass()
        waiters = {r.waiter for r in decision.reclaims}
        for reclaim in decision.reclaims:
            event("preempted" if reclaim.preempted else "shrunk")
        if not waiters:
            return
        # Room was made: by the next pass (nothing else changed) its job runs (it may
        # have started at once when its queue's limit, not slots, held it back),
        # unless another waiting job took the room first (one of another queue's
        # guarantee, earlier in the order, when the guarantees overlap).
        before = self.sim.view
        self.sim.report_running()
        follow_up = self._pass()
        others = {r.waiter for r in follow_up.reclaims} - waiters
        waiting_before = {
            j for j, r in before.jobs.items()
            if not r.phase.is_terminal() and len(before.assignments.get(j, {})) < r.spec.min_nodes
        }
        started = {j for j in waiting_before
                   if len(self.sim.placed(j)) >= self.sim.job(j).spec.min_nodes}
        for job_id in waiters:
            placed = len(self.sim.placed(job_id)) >= self.sim.job(job_id).spec.min_nodes
            # (or a job earlier in the order holds it now, for its own start)
            assert placed or started - waiters or others, (
                f"{job_id} did not start on the room reclaimed for it, nor did another job"
            )


QueueMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQueuesThroughRandomClusterHistories = QueueMachine.TestCase


ACTIONS = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from([*QUEUE_NAMES, "default"]),
              st.integers(1, 3), st.integers(0, 3), st.integers(1, 2), st.integers(-1, 1)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("kill"), st.integers(0, 30)),
    st.tuples(st.just("add"), st.integers(1, 2)),
    st.tuples(st.just("wait"), st.integers(0, 40)),
)


@given(
    slots=st.lists(st.integers(1, 2), min_size=2, max_size=6),
    queues=st.lists(st.tuples(st.integers(0, 4), st.none() | st.integers(1, 6),
                              st.sampled_from([0.5, 1.0, 3.0])),
                    min_size=len(QUEUE_NAMES), max_size=len(QUEUE_NAMES)),
    borrowers=st.lists(st.tuples(st.sampled_from(QUEUE_NAMES), st.integers(1, 2)),
                       min_size=2, max_size=4),
    actions=st.lists(ACTIONS, min_size=1, max_size=25),
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_pass_of_a_busy_cluster_keeps_the_queue_invariants(
    slots: list[int], queues: list[tuple[int, int | None, float]],
    borrowers: list[tuple[str, int]], actions: list[tuple[object, ...]],
) -> None:
    """The state machine's checks, over a cluster full of borrowers and then a
    random sequence of submissions, completions, cancels, node losses and joins,
    each followed by a reconcile pass (and its follow-up when it reclaimed)."""
    note(repr((slots, queues, borrowers, actions)))
    machine = QueueMachine()
    machine.a_cluster_of_teams_full_of_borrowers(slots, queues, borrowers)
    for action in actions:
        kind, *args = action
        if kind == "submit":
            queue, low, extra, nproc, priority = args
            machine.submit(str(queue), int(low), int(extra), int(nproc), int(priority))  # type: ignore[call-overload]
        elif kind == "finish" and machine.sim.view.assignments:
            machine.a_job_finishes(int(args[0]))  # type: ignore[call-overload]
        elif kind == "cancel" and machine._live():
            machine.cancel(int(args[0]))  # type: ignore[call-overload]
        elif kind == "kill" and len(machine.sim.view.nodes) > 1:
            machine.kill_node(int(args[0]))  # type: ignore[call-overload]
        elif kind == "add":
            machine.add_node(int(args[0]))  # type: ignore[call-overload]
        elif kind == "wait":
            machine.time_passes(int(args[0]))  # type: ignore[call-overload]
        machine.reconcile()


@given(
    smalls=st.lists(st.tuples(st.integers(0, 600), st.integers(60, 900)), min_size=5,
                    max_size=40),
    big_at=st.integers(0, 300),
    nodes=st.integers(2, 5),
    queue_of_small=st.sampled_from(["default", "b"]),
)
@settings(max_examples=25, deadline=None)
def test_a_job_that_cannot_fit_starts_within_the_reservation_bound(
    smalls: list[tuple[int, int]], big_at: int, nodes: int, queue_of_small: str
) -> None:
    """Small one-node jobs keep arriving, in another queue or behind the big job in
    its own (lower priority); a job needing every node waits at most
    ``reserve_after_s`` for backfill, then for the longest small job running on
    its nodes (every small job here runs at most 900 s on one node), plus a pass
    or two. (Jobs ahead of it in its own queue are not backfill: it waits for them.)"""
    reserve_after = 120.0
    dt = 10.0
    sim = Sim(policy=Policy(reserve_after_s=reserve_after))
    sim.join(*(make_node(f"n{i}") for i in range(nodes)))
    sim.set_queue("b", 0)
    works = [Work(make_job(f"s{i}", queue=queue_of_small, priority=-1), float(at),
                  float(length))
             for i, (at, length) in enumerate(smalls)]
    big = Work(make_job("big", min_nodes=nodes, max_nodes=nodes), float(big_at), 60.0)
    workload = Workload(sim, [*works, big], dt=dt, restart_s=0.0)
    workload.run(big_at + reserve_after + 900 + 4 * dt)
    assert "big" in workload.starts, "the big job never started"
    assert workload.starts["big"] - big_at <= reserve_after + 900 + 3 * dt
