"""Restarts the agents charge to a node's budget, as the job counts and tells them.

An agent counts a node's ``worker_failed`` restarts per assignment generation:
a node that leaves and rejoins starts again from 0. The job's ``restarts`` add
up every generation's (:func:`service.scheduler.restart_charges`), and each
charged restart gets one ``restart_charged`` event, derived from the record in
etcd (so a new leader, which plans on the same view, repeats none).
"""

from __future__ import annotations

from datetime import datetime, timezone

from hypothesis import given
from hypothesis import strategies as st

from rendezvous.records import RUNNER_RANK, JobNodeState, JobNodeStatus, WorkerError
from service.api.models import ChargedRestarts, EventReason, JobPhase
from service.coordinator.views import job_view
from service.scheduler import plan
from service.scheduler.reports import restart_charges
from tests.unit.service.sim import Sim, make_job, make_node

T = datetime(2026, 1, 1, tzinfo=timezone.utc)


def status(node: str, generation: int, charged: int,
           state: JobNodeState = JobNodeState.RUNNING) -> JobNodeStatus:
    return JobNodeStatus(job_id="j", node_id=node, generation=generation, state=state,
                         restart_count=charged, restart_reasons={"worker_failed": charged},
                         updated_at=T)


def running_on(*nodes: str) -> Sim:
    sim = Sim()
    sim.join(*(make_node(n) for n in nodes))
    sim.submit(make_job("j", min_nodes=1, max_nodes=len(nodes)))
    sim.settle()
    assert sim.phase("j") == JobPhase.RUNNING
    return sim


def charged_events(sim: Sim) -> list[tuple[list[str], str]]:
    return [(e.nodes, e.message) for e in sim.events["j"]
            if e.reason == EventReason.RESTART_CHARGED]


# the pure fold -------------------------------------------------------------------------


def test_a_new_generation_counts_all_of_its_restarts_and_the_same_one_only_its_rise() -> None:
    seen = {"a": ChargedRestarts(generation=3, worker_failed=2),
            "b": ChargedRestarts(generation=4, worker_failed=1)}
    folded, rises = restart_charges(
        seen, {"a": 3, "b": 7}, {"a": status("a", 3, 3), "b": status("b", 7, 2)}
    )
    assert [(c.node_id, c.before, c.count) for c in rises] == [("a", 2, 3), ("b", 0, 2)]
    assert folded == {"a": ChargedRestarts(generation=3, worker_failed=3),
                      "b": ChargedRestarts(generation=7, worker_failed=2)}
    # Folded again: nothing new.
    assert restart_charges(folded, {"a": 3, "b": 7},
                           {"a": status("a", 3, 3), "b": status("b", 7, 2)}) == (folded, [])


def test_reports_not_in_force_count_nothing_and_unassigned_nodes_are_forgotten() -> None:
    seen = {"a": ChargedRestarts(generation=3, worker_failed=2),
            "gone": ChargedRestarts(generation=2, worker_failed=4)}
    # a's assignment is now generation 5 but its agent still reports 3; c has no report.
    folded, rises = restart_charges(
        seen, {"a": 5, "c": 6}, {"a": status("a", 3, 9), "gone": status("gone", 2, 8)}
    )
    assert (folded, rises) == ({}, [])


@given(st.lists(st.tuples(st.sampled_from("abc"),
                          st.sampled_from(["charge", "rejoin", "pass", "lost_pass"])),
                max_size=60))
def test_every_charged_restart_is_counted_once_however_nodes_rejoin_and_passes_fall(
    script: list[tuple[str, str]],
) -> None:
    """Agents charge restarts and nodes leave and rejoin at new generations;
    passes fold, and some of their writes are lost (the leader died first). A
    node leaves in a pass that is written (the one that deletes its
    assignment). At the end the job counts exactly the restarts charged."""
    generations = {"a": 1, "b": 2, "c": 3}
    counts = {"a": 0, "b": 0, "c": 0}
    next_generation = 4
    record: dict[str, ChargedRestarts] = {}
    total = charged = 0

    def fold(written: bool) -> None:
        nonlocal record, total
        statuses = {n: status(n, generations[n], counts[n]) for n in generations}
        folded, rises = restart_charges(record, generations, statuses)
        if written:
            record = folded
            total += sum(c.count - c.before for c in rises)

    for node, action in script:
        if action == "charge":
            counts[node] += 1
            charged += 1
        elif action == "rejoin":
            fold(True)
            generations[node], counts[node] = next_generation, 0
            next_generation += 1
        else:
            fold(action == "pass")
    fold(True)
    assert total == charged
    fold(True)
    assert total == charged


# through the scheduler -----------------------------------------------------------------


def test_restarts_of_a_node_that_leaves_and_rejoins_add_up_with_one_event_each() -> None:
    sim = running_on("n1", "n2")
    first = sim.assignment("j", "n2").generation
    boom = WorkerError(rank=1, exit_code=1, message="rank 1 failed with exit code 1: boom")
    sim.report("j", "n2", charged=1, remaining_restarts=4, error=boom)
    sim.step()
    sim.report("j", "n2", charged=2, remaining_restarts=3, error=boom)
    sim.step()
    assert sim.job("j").restarts["worker_failed"] == 2
    # n2 leaves the job and comes back: its new generation counts from 0.
    sim.kill("n2")
    sim.step()
    sim.join(make_node("n2"))
    sim.step()
    assert sim.assignment("j", "n2").generation > first
    sim.report("j", "n2", charged=1, remaining_restarts=4, error=boom)
    sim.step()
    assert sim.job("j").restarts["worker_failed"] == 3
    events = charged_events(sim)
    assert [nodes for nodes, _ in events] == [["n2"]] * 3
    assert {e.world_size for e in sim.events["j"] if e.reason == EventReason.RESTART_CHARGED} == {2}
    assert events[1][1] == ("a worker failed on n2; restart 2 charged to its budget (3 left): "
                            "rank 1 failed with exit code 1: boom")
    # The same view planned again (a new leader after the write): nothing repeated.
    assert plan(sim.view, sim.clock) == []


def test_a_runner_failure_is_named_as_such_in_its_restart_event() -> None:
    sim = running_on("n1")
    killed = WorkerError(rank=RUNNER_RANK, exit_code=-9, signal="SIGKILL",
                         message="the runner (pid 42) was killed by SIGKILL")
    sim.report("j", "n1", charged=1, remaining_restarts=4, error=killed)
    sim.step()
    [(nodes, message)] = charged_events(sim)
    assert nodes == ["n1"]
    assert message.startswith("the runner failed on n1; restart 1 charged")
    assert message.endswith(": the runner (pid 42) was killed by SIGKILL")


def test_a_charge_not_written_is_told_by_the_next_leader_once() -> None:
    sim = running_on("n1")
    sim.report("j", "n1", charged=1, remaining_restarts=4)
    lost = plan(sim.view, sim.clock)  # the leader died before writing this
    [change] = sim.step()  # the next one plans on the same etcd
    assert [e.reason for e in change.events] == [e.reason for e in lost[0].events]
    assert sim.step() == []
    assert len(charged_events(sim)) == 1


def test_the_last_charge_of_a_spent_budget_is_counted_but_told_by_the_failure() -> None:
    sim = running_on("n1")
    cause = WorkerError(rank=RUNNER_RANK, exit_code=1,
                        message="working directory /w/exprs/run1 does not exist")
    sim.report("j", "n1", charged=1, error=cause)
    sim.step()
    sim.report("j", "n1", JobNodeState.FAILED, charged=2, error=cause)
    [change] = sim.step()
    record = sim.job("j")
    assert record.phase == JobPhase.FAILED
    assert record.restarts["worker_failed"] == 2
    assert [e.reason for e in change.events] == [EventReason.WORKER_FAILED]
    assert change.events[0].message == (
        "the job failed on n1: working directory /w/exprs/run1 does not exist")
    assert len(charged_events(sim)) == 1


def test_a_worker_failure_that_spends_the_budget_still_says_so() -> None:
    sim = running_on("n1")
    sim.report("j", "n1", JobNodeState.FAILED, charged=1,
               error=WorkerError(rank=0, exit_code=3, message="rank 0 failed"))
    [change] = sim.step()
    assert change.events[-1].message == (
        "a worker failed on n1 and the restart budget is spent: exit code 3")
    assert sim.job("j").restarts == {"worker_failed": 1}


def test_the_job_view_counts_charges_the_scheduler_has_not_folded_yet_once() -> None:
    sim = running_on("n1", "n2")
    sim.report("j", "n1", charged=2)
    sim.report("j", "n2", charged=1)
    before = job_view(sim.job("j"), sim.view.statuses["j"])
    assert before.restarts == {"worker_failed": 3} and before.restart_count == 3
    sim.step()
    after = job_view(sim.job("j"), sim.view.statuses["j"])
    assert after.restarts == before.restarts
