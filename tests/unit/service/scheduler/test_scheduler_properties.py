"""Random clusters through many reconcile passes: what must hold after every one.

A hypothesis state machine plays nodes (joining, dying, coming back, draining),
users (submit, PATCH, cancel) and agents (reports of any state, at the right
or a wrong world size, for the current or an older generation), with a
reconcile pass as one more rule. After each pass it checks, for every job:

* no live node runs more processes than it has slots; no assignment stays on a
  dead or draining node; every assignment matches its job's current spec and
  node selector, and ``JobRecord.nodes`` mirrors the assignments;
* a job holds at most ``max_nodes``; a non-terminal job is ``PENDING`` exactly
  when it holds fewer than ``min_nodes``, and then only survivors of an earlier
  pass (the gang rule: a job never gains nodes and stays below its minimum);
* every assignment written carries a generation the job never used before;
* events are numbered 0, 1, 2, ... per job, API events included;
* phases move only along ``TRANSITIONS``; a terminal job has no assignments,
  ``finished_at`` and ``exit_reason`` set, and is never written again;
* the same view gives the same plan;
* a pass cut anywhere in a job's write (the leader dies between the
  transactions of a split change, :func:`service.coordinator.store.split_ops`) never makes
  a later pass hand out a generation twice, and the next pass restores all of
  the above.

A settle rule lets every agent report until a pass changes nothing (within a
few passes) and checks that nothing is left that the scheduler could still do.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rendezvous.records import Assignment, JobNodeState, WorkerError
from rendezvous.registry import NodeInfo
from service.api.models import TRANSITIONS, JobPhase, JobRecord
from service.scheduler import ClusterView, JobChange, plan
from tests.unit.service.sim import Sim, apply, make_job, make_node

REPORTS = [
    JobNodeState.RUNNING, JobNodeState.RUNNING, JobNodeState.RUNNING, JobNodeState.STARTING,
    JobNodeState.RESTARTING, JobNodeState.SUCCEEDED, JobNodeState.FAILED,
    JobNodeState.CANCELLED,
]


def free_slots(view: ClusterView) -> dict[str, int]:
    """Slots not used by any assignment, on live nodes that are not draining."""
    free = {n: info.slots for n, info in view.nodes.items() if n not in view.draining}
    for per_node in view.assignments.values():
        for node_id, a in per_node.items():
            if node_id in free:
                free[node_id] -= a.nproc_per_node
    return free


def fits(record: JobRecord, info: NodeInfo) -> bool:
    return all(info.labels.get(k) == v for k, v in record.spec.node_selector.items())


def new_generations(
    held: dict[str, Assignment], put: dict[str, Assignment]
) -> dict[str, Assignment]:
    """The assignments of ``put`` that hand out a generation: all but those that
    rewrite a node's assignment in place (same generation, only the bounds differ)."""
    return {
        node_id: a for node_id, a in put.items()
        if node_id not in held or held[node_id].generation != a.generation
        or a != held[node_id].model_copy(
            update={"min_nodes": a.min_nodes, "max_nodes": a.max_nodes})
    }


def check_pass(before: ClusterView, changes: list[JobChange], after: ClusterView,
               generations: dict[str, set[int]]) -> None:
    """What must hold of one pass from ``before`` to ``after``."""
    by_job = {c.job_id: c for c in changes}
    assert len(by_job) == len(changes), "one change per job"
    for job_id, change in by_job.items():
        old, new = before.jobs[job_id], change.record
        if old.phase.is_terminal():
            assert new == old and not change.put and not change.events, (
                f"{job_id} is {old.phase.value} and was written again"
            )
        assert new.phase == old.phase or new.phase in TRANSITIONS[old.phase], (
            f"{job_id}: {old.phase.value} -> {new.phase.value}"
        )
        assert [e.seq for e in change.events] == list(
            range(old.next_event, new.next_event)
        ), f"{job_id}: events not numbered from {old.next_event}"
        for reason, count in old.restarts.items():
            assert new.restarts.get(reason, 0) >= count
        held = before.assignments.get(job_id, {})
        fresh = new_generations(held, change.put)
        for node_id, a in change.put.items():
            if node_id not in fresh:  # new bounds written in place: nothing restarts
                assert (a.min_nodes, a.max_nodes) == (new.spec.min_nodes, new.spec.max_nodes)
                assert a != held[node_id], f"{job_id}: {node_id}'s assignment written again"
                continue
            assert old.next_generation <= a.generation < new.next_generation
            assert a.generation not in generations.setdefault(job_id, set()), (
                f"{job_id}: generation {a.generation} given again (to {node_id})"
            )
            generations[job_id].add(a.generation)
        assert len({a.generation for a in fresh.values()}) == len(fresh)

    used: dict[str, int] = {}
    for job_id, record in after.jobs.items():
        spec = record.spec
        placed = after.assignments.get(job_id, {})
        assert record.nodes == {n: a.generation for n, a in placed.items()}
        if record.phase.is_terminal():
            assert placed == {}, f"{job_id} is {record.phase.value} and still placed"
            assert record.finished_at is not None and record.exit_reason is not None
            continue
        assert record.finished_at is None and record.exit_reason is None
        assert len(placed) <= spec.max_nodes, f"{job_id} above its maximum"
        assert (record.phase == JobPhase.PENDING) == (len(placed) < spec.min_nodes), (
            f"{job_id} is {record.phase.value} on {len(placed)} of {spec.min_nodes}.."
            f"{spec.max_nodes} nodes"
        )
        if len(placed) < spec.min_nodes:
            survivors = set(before.assignments.get(job_id, {}))
            assert set(placed) <= survivors, f"{job_id} got part of its gang"
        for node_id, a in placed.items():
            assert node_id in after.nodes, f"{job_id} still on dead {node_id}"
            assert node_id not in after.draining, f"{job_id} still on draining {node_id}"
            assert fits(record, after.nodes[node_id])
            assert a.job_id == job_id
            assert (a.min_nodes, a.max_nodes, a.nproc_per_node) == (
                spec.min_nodes, spec.max_nodes, spec.nproc_per_node
            )
            used[node_id] = used.get(node_id, 0) + a.nproc_per_node
    for node_id, n in used.items():
        assert n <= after.nodes[node_id].slots, f"{node_id} runs {n} processes"


def check_fixed_point(view: ClusterView) -> None:
    """Nothing is left to do: every placed job runs, no free node could help anyone."""
    free = free_slots(view)
    for job_id, record in view.jobs.items():
        if record.phase.is_terminal():
            continue
        spec = record.spec
        placed = view.assignments.get(job_id, {})
        if len(placed) >= spec.min_nodes:
            assert record.phase == JobPhase.RUNNING, f"{job_id} settled {record.phase.value}"
        usable = [
            n for n, slots in free.items()
            if n not in placed and slots >= spec.nproc_per_node
            and fits(record, view.nodes[n])
        ]
        if len(placed) >= spec.min_nodes:
            assert len(placed) == spec.max_nodes or not usable, (
                f"{job_id} could grow onto {usable}"
            )
        else:
            assert len(usable) < spec.min_nodes - len(placed), (
                f"{job_id} could start on {usable}"
            )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim()
        self.known: dict[str, NodeInfo] = {}  # every node ever seen: ids come back as they were
        self.generations: dict[str, set[int]] = {}
        self.jobs = 0

    @initialize(
        slots=st.lists(st.integers(1, 3), min_size=1, max_size=5),
        jobs=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2), st.integers(1, 2),
                                st.integers(-1, 1)), min_size=1, max_size=4),
    )
    def a_busy_cluster(self, slots: list[int], jobs: list[tuple[int, int, int, int]]) -> None:
        """Start with nodes and jobs, and let them run: the rules then break things."""
        for n in slots:
            self.add_node(n, None)
        for min_nodes, extra, nproc, priority in jobs:
            self.submit(min_nodes, extra, nproc, priority, None)
        self.settle()

    # nodes ---------------------------------------------------------------------------

    @rule(slots=st.integers(1, 3), gpu=st.sampled_from([None, "a", "b"]))
    def add_node(self, slots: int, gpu: str | None) -> None:
        node = make_node(f"n{len(self.known)}", slots=slots,
                         labels={"gpu": gpu} if gpu else {})
        self.known[node.node_id] = node
        self.sim.join(node)

    @precondition(lambda self: self.sim.view.nodes)
    @rule(i=st.integers(0, 30))
    def kill_node(self, i: int) -> None:
        live = sorted(self.sim.view.nodes)
        self.sim.kill(live[i % len(live)])

    @precondition(lambda self: len(self.known) > len(self.sim.view.nodes))
    @rule(i=st.integers(0, 30))
    def node_returns(self, i: int) -> None:
        dead = sorted(set(self.known) - set(self.sim.view.nodes))
        self.sim.join(self.known[dead[i % len(dead)]])

    @precondition(lambda self: self.sim.view.nodes)
    @rule(i=st.integers(0, 30))
    def drain(self, i: int) -> None:
        live = sorted(self.sim.view.nodes)
        self.sim.drain(live[i % len(live)])

    @precondition(lambda self: self.sim.view.draining)
    @rule(i=st.integers(0, 30))
    def undrain(self, i: int) -> None:
        drained = sorted(self.sim.view.draining)
        self.sim.undrain(drained[i % len(drained)])

    # users ---------------------------------------------------------------------------

    @rule(
        min_nodes=st.integers(1, 3), extra=st.integers(0, 2), nproc=st.integers(1, 2),
        priority=st.integers(-1, 1), gpu=st.sampled_from([None, None, "a"]),
    )
    def submit(self, min_nodes: int, extra: int, nproc: int, priority: int,
               gpu: str | None) -> None:
        self.jobs += 1
        self.sim.submit(make_job(
            f"j{self.jobs}", min_nodes=min_nodes, max_nodes=min_nodes + extra, nproc=nproc,
            priority=priority, created=self.jobs, selector={"gpu": gpu} if gpu else None,
        ))

    def _open_jobs(self) -> list[str]:
        """Jobs the API still lets a user scale or cancel."""
        return sorted(
            j for j, r in self.sim.view.jobs.items()
            if not r.phase.is_terminal() and not r.cancel_requested
        )

    @precondition(lambda self: self._open_jobs())
    @rule(i=st.integers(0, 30))
    def cancel(self, i: int) -> None:
        jobs = self._open_jobs()
        self.sim.cancel(jobs[i % len(jobs)])

    @precondition(lambda self: self._open_jobs())
    @rule(i=st.integers(0, 30), min_nodes=st.integers(1, 3), extra=st.integers(0, 2))
    def patch(self, i: int, min_nodes: int, extra: int) -> None:
        jobs = self._open_jobs()
        self.sim.patch(jobs[i % len(jobs)], min_nodes=min_nodes, max_nodes=min_nodes + extra)

    # agents --------------------------------------------------------------------------

    @precondition(lambda self: self.sim.view.assignments)
    @rule(data=st.data())
    def agents_report(self, data: st.DataObject) -> None:
        pairs = self._placed_pairs()
        chosen = data.draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=4,
                                    unique=True))
        for job_id, node_id in chosen:
            state = data.draw(st.sampled_from(REPORTS))
            generation = self.sim.assignment(job_id, node_id).generation
            stale = data.draw(st.integers(0, 5)) == 0
            wrong_size = data.draw(st.integers(0, 3)) == 0
            self.sim.report(
                job_id, node_id, state,
                generation=generation - 1 if stale else generation,
                world_size=0 if wrong_size else None,
                error=WorkerError(rank=0, exit_code=1) if state == JobNodeState.FAILED else None,
            )

    def _placed_pairs(self) -> list[tuple[str, str]]:
        return sorted(
            (job, node) for job, per_node in self.sim.view.assignments.items()
            for node in per_node
        )

    @precondition(lambda self: self.sim.view.assignments)
    @rule(i=st.integers(0, 30))
    def runner_leaves(self, i: int) -> None:
        """A node's runner stops (SIGTERM) and leaves the job: its node stays live."""
        pairs = self._placed_pairs()
        self.sim.report(*pairs[i % len(pairs)], JobNodeState.CANCELLED)

    # the coordinator -----------------------------------------------------------------

    @rule()
    def reconcile(self) -> None:
        before = self.sim.view
        assert plan(before, self.sim.clock) == plan(before, self.sim.clock)
        changes = self.sim.step()
        check_pass(before, changes, self.sim.view, self.generations)

    @rule(data=st.data())
    def reconcile_cut_short(self, data: st.DataObject) -> None:
        """A pass whose writes stop part-way: earlier jobs written, one in part, none after.

        A job's change is written in the order of ``service.coordinator.store.job_ops``:
        the events and the record, then the deletes, then the new assignments.
        """
        changes = self.sim.plan()
        if not changes:
            return
        cut = data.draw(st.integers(0, len(changes) - 1))
        change = changes[cut]
        ops: list[tuple[str, str]] = [("record", "")]
        ops += [("delete", n) for n in change.delete]
        ops += [("put", n) for n in sorted(change.put)]
        done = ops[:data.draw(st.integers(0, len(ops)))]
        wrote_record = ("record", "") in done
        partial = JobChange(
            change.job_id,
            change.record if wrote_record else self.sim.job(change.job_id),
            {n: change.put[n] for kind, n in done if kind == "put"},
            [n for kind, n in done if kind == "delete"],
            change.events if wrote_record else [],
        )
        written = [*changes[:cut], partial]
        for c in written:
            held = self.sim.view.assignments.get(c.job_id, {})
            for node_id, a in new_generations(held, c.put).items():
                assert a.generation not in self.generations.setdefault(c.job_id, set()), (
                    f"{c.job_id}: generation {a.generation} given again (to {node_id})"
                )
                self.generations[c.job_id].add(a.generation)
            self.sim.events.setdefault(c.job_id, []).extend(c.events)
        self.sim.view = apply(self.sim.view, written)
        # The next pass (a new leader's, or the retry) comes before anything
        # else changes, and restores every invariant. (Until it does, a node may
        # hold more than its slots: a job written before the cut took slots that
        # a job after it had not released yet; etcd alone cannot make a whole
        # pass atomic.)
        before = self.sim.view
        changes = self.sim.step()
        check_pass(before, changes, self.sim.view, self.generations)

    @rule()
    def settle(self) -> None:
        for _ in range(6):
            self.sim.report_running()
            before = self.sim.view
            changes = self.sim.step()
            check_pass(before, changes, self.sim.view, self.generations)
            if not changes:
                check_fixed_point(self.sim.view)
                return
        raise AssertionError(f"no fixed point after 6 passes; last: {changes}")

    @invariant()
    def events_are_numbered_per_job_from_zero(self) -> None:
        for job_id, events in self.sim.events.items():
            assert [e.seq for e in events] == list(range(len(events)))
            assert self.sim.job(job_id).next_event == len(events)


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTheSchedulerThroughRandomClusterHistories = SchedulerMachine.TestCase


@given(
    priorities=st.lists(st.integers(-2, 2), min_size=1, max_size=8),
    nodes=st.integers(0, 6),
)
@settings(max_examples=60, deadline=None)
def test_scarce_nodes_go_to_the_highest_priorities_then_the_oldest(
    priorities: list[int], nodes: int
) -> None:
    sim = Sim()
    sim.join(*(make_node(f"n{i}") for i in range(nodes)))
    # Submitted in a shuffled order of creation time: the id says nothing.
    for i, priority in enumerate(priorities):
        sim.submit(make_job(f"j{i}", priority=priority, created=(i * 7) % 11))
    sim.settle()
    order = sorted(sim.view.jobs.values(), key=lambda r: (-r.spec.priority, r.created_at))
    expected = {r.job_id for r in order[:nodes]}
    assert {j for j in sim.view.jobs if sim.placed(j)} == expected


@given(
    sizes=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=5),
    slots=st.lists(st.integers(1, 2), min_size=0, max_size=6),
    nproc=st.integers(1, 2),
)
@settings(max_examples=60, deadline=None)
def test_from_an_empty_cluster_every_job_gets_all_of_its_minimum_or_nothing(
    sizes: list[tuple[int, int]], slots: list[int], nproc: int
) -> None:
    sim = Sim()
    sim.join(*(make_node(f"n{i}", slots=s) for i, s in enumerate(slots)))
    for i, (low, extra) in enumerate(sizes):
        sim.submit(make_job(f"j{i}", min_nodes=low, max_nodes=low + extra, nproc=nproc,
                            created=i))
    sim.step()
    for job_id, record in sim.view.jobs.items():
        held = len(sim.placed(job_id))
        assert held == 0 or record.spec.min_nodes <= held <= record.spec.max_nodes
    sim.settle()
    check_fixed_point(sim.view)
