"""The scheduler's decisions, pass by pass, as a user of the service expects them.

Each test drives :func:`service.scheduler.plan` through :class:`Sim`, which
writes every plan back into the view and plays the agents, nodes and API.
Random clusters are in ``test_scheduler_properties.py``.

Behaviour pinned here on purpose, though another scheduler could choose
otherwise: a job that cannot reach its minimum reserves nothing (smaller jobs
backfill around it); nothing is preempted (a job that grew above its minimum
keeps its nodes); survivors below the minimum keep their assignments while the
job is PENDING; slots freed by a cancel are given out in the same pass.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from rendezvous.records import JobNodeState, WorkerError
from service.api.models import EventReason, ExitReason, JobPhase
from service.scheduler import ClusterView, plan
from tests.unit.service.sim import Sim, make_job, make_node


def cluster(*slots: int, **labels: dict[str, str]) -> Sim:
    """Nodes n1, n2, ... with the given slots (labels by node id)."""
    sim = Sim()
    sim.join(*(make_node(f"n{i}", slots=s, labels=labels.get(f"n{i}"))
               for i, s in enumerate(slots, start=1)))
    return sim


def running(sim: Sim, *job_ids: str) -> None:
    """Let the jobs start and their agents report until nothing changes."""
    sim.settle()
    for job_id in job_ids:
        assert sim.phase(job_id) == JobPhase.RUNNING


def condition(sim: Sim, job_id: str, type_: str) -> tuple[bool, str]:
    [cond] = [c for c in sim.job(job_id).conditions if c.type == type_]
    return cond.status, cond.reason


# gang start and growth -------------------------------------------------------------------


def test_a_job_whose_minimum_does_not_fit_stays_pending_with_no_assignments() -> None:
    sim = cluster(1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=3))
    sim.step()
    assert sim.placed("j") == set()
    assert sim.phase("j") == JobPhase.PENDING
    assert sim.job("j").started_at is None
    assert condition(sim, "j", "Scheduled") == (False, EventReason.BELOW_MIN_NODES.value)
    assert sim.step() == []  # and nothing more to do until the cluster changes


def test_a_pending_job_starts_on_its_whole_minimum_at_once_when_a_node_joins() -> None:
    sim = cluster(1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    sim.step()
    sim.join(make_node("n2"))
    [change] = sim.step()
    assert set(change.put) == {"n1", "n2"}
    assert sim.phase("j") == JobPhase.RUNNING
    assert sim.job("j").started_at == change.events[0].time
    scheduled = [e for e in change.events if e.reason == EventReason.SCHEDULED]
    assert scheduled[0].nodes == ["n1", "n2"]
    assert scheduled[0].world_size == 2
    assert sim.job("j").nodes == {n: a.generation for n, a in change.put.items()}


def test_a_first_start_is_not_counted_as_a_restart() -> None:
    sim = cluster(1, 1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=3))
    sim.step()
    assert sim.placed("j") == {"n1", "n2", "n3"}
    assert sim.phase("j") == JobPhase.RUNNING
    assert sim.job("j").restarts == {}


def test_a_job_grows_to_its_maximum_on_free_nodes_and_never_beyond() -> None:
    sim = cluster(1, 1, 1, 1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=3))
    running(sim, "j")
    assert len(sim.placed("j")) == 3
    sim.join(make_node("n6"), make_node("n7"))
    assert sim.step() == []
    assert len(sim.placed("j")) == 3


def test_a_running_job_grows_onto_a_node_that_joins_and_runs_again_at_the_new_size() -> None:
    sim = cluster(1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=3, nproc=1))
    running(sim, "j")
    before = sim.assignment("j", "n1")
    sim.join(make_node("n2"))
    [change] = sim.step()
    assert set(change.put) == {"n2"} and change.delete == []
    assert change.events[0].reason == EventReason.NODE_JOINED
    assert sim.phase("j") == JobPhase.RESCALING
    assert sim.job("j").restarts == {"node_joined": 1}
    assert sim.assignment("j", "n1") == before  # the survivor keeps its assignment
    # An agent still at the old size does not count as running at the new one.
    sim.report("j", "n1", world_size=1)
    sim.report("j", "n2", world_size=2)
    sim.step()
    assert sim.phase("j") == JobPhase.RESCALING
    sim.report("j", "n1", world_size=2)
    sim.step()
    assert sim.phase("j") == JobPhase.RUNNING
    assert condition(sim, "j", "Running") == (True, EventReason.RESTARTED.value)


def test_a_job_never_gets_two_assignments_on_one_node() -> None:
    sim = cluster(8)
    sim.submit(make_job("j", min_nodes=1, max_nodes=4))
    running(sim, "j")
    assert sim.placed("j") == {"n1"}
    assert sim.used("n1") == 1


def test_two_jobs_of_one_process_share_a_node_with_two_slots() -> None:
    sim = cluster(2)
    sim.submit(make_job("a", created=0))
    sim.submit(make_job("b", created=1))
    running(sim, "a", "b")
    assert sim.placed("a") == sim.placed("b") == {"n1"}
    assert sim.used("n1") == 2


def test_a_third_job_does_not_fit_a_node_whose_slots_are_used() -> None:
    sim = cluster(2)
    for i, name in enumerate("abc"):
        sim.submit(make_job(name, created=i))
    sim.settle()
    assert sim.placed("c") == set()
    assert sim.phase("c") == JobPhase.PENDING
    assert sim.used("n1") == 2


def test_a_job_of_two_processes_per_node_does_not_fit_a_one_slot_node() -> None:
    sim = cluster(1, 2)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2, nproc=2))
    running(sim, "j")
    assert sim.placed("j") == {"n2"}
    assert sim.assignment("j", "n2").nproc_per_node == 2


def test_a_job_runs_only_on_nodes_whose_labels_match_its_selector() -> None:
    sim = cluster(1, 1, 1, n1={"gpu": "a100"}, n2={"gpu": "h100", "zone": "x"}, n3={"zone": "x"})
    sim.submit(make_job("j", min_nodes=1, max_nodes=3, selector={"gpu": "h100"}))
    sim.submit(make_job("k", min_nodes=2, max_nodes=2, selector={"gpu": "h100"}))
    sim.settle()
    assert sim.placed("j") == {"n2"}
    assert sim.placed("k") == set()  # two nodes match nothing but n2


def test_scarce_capacity_goes_to_higher_priority_first_then_to_the_oldest() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("low", priority=0, created=0))
    sim.submit(make_job("high-new", priority=5, created=2))
    sim.submit(make_job("high-old", priority=5, created=1))
    sim.settle()
    assert sim.placed("high-old") and sim.placed("high-new")
    assert sim.placed("low") == set()
    sim.cancel("high-old")
    sim.settle()
    assert sim.placed("low")  # the freed node goes to the next in line


def test_every_job_gets_its_minimum_before_any_grows_toward_its_maximum() -> None:
    sim = cluster(1, 1, 1)
    sim.submit(make_job("big", min_nodes=1, max_nodes=3, priority=10))
    sim.submit(make_job("small", min_nodes=2, max_nodes=2, priority=0))
    running(sim, "big", "small")
    assert len(sim.placed("big")) == 1
    assert len(sim.placed("small")) == 2


def test_a_high_priority_job_that_cannot_reach_its_minimum_does_not_block_a_smaller_one() -> None:
    """Backfill, chosen on purpose: idle nodes help nobody while the big job waits.

    The price is that a big job can wait while smaller ones keep taking the
    nodes it needs (no reservation); see the next test for preemption.
    """
    sim = cluster(1, 1)
    sim.submit(make_job("big", min_nodes=3, max_nodes=3, priority=10))
    sim.submit(make_job("small", min_nodes=1, max_nodes=2, priority=0, created=1))
    running(sim, "small")
    assert sim.placed("big") == set()
    assert sim.phase("big") == JobPhase.PENDING
    assert len(sim.placed("small")) == 2


def test_nodes_are_not_taken_back_from_a_running_job_for_a_higher_priority_one() -> None:
    """No preemption: a job that grew above its minimum keeps its nodes.

    Documented behaviour, not a promise of fairness: the pending job starts
    once enough nodes are free (here, when the running job is cancelled).
    """
    sim = cluster(1, 1)
    sim.submit(make_job("elastic", min_nodes=1, max_nodes=2, priority=0))
    running(sim, "elastic")
    sim.submit(make_job("urgent", min_nodes=1, max_nodes=1, priority=100, created=5))
    sim.settle()
    assert len(sim.placed("elastic")) == 2
    assert sim.phase("urgent") == JobPhase.PENDING
    sim.cancel("elastic")
    sim.settle()
    assert sim.phase("urgent") == JobPhase.RUNNING


# shrinking -------------------------------------------------------------------------------


def test_a_lost_node_shrinks_the_job_which_rescales_until_the_survivors_run_at_the_new_size(
) -> None:
    sim = cluster(2, 2, 2)
    sim.submit(make_job("j", min_nodes=1, max_nodes=3, nproc=2))
    running(sim, "j")
    survivors = {n: sim.assignment("j", n) for n in ("n1", "n2")}
    sim.kill("n3")
    [change] = sim.step()
    assert change.delete == ["n3"] and change.put == {}
    [lost] = [e for e in change.events if e.reason == EventReason.NODE_LOST]
    assert lost.nodes == ["n3"]
    assert lost.world_size == 4
    assert sim.phase("j") == JobPhase.RESCALING
    assert sim.job("j").restarts == {"node_lost": 1}
    assert sim.job("j").nodes == {n: a.generation for n, a in survivors.items()}
    assert {n: sim.assignment("j", n) for n in survivors} == survivors
    # The survivors still report the old world size (6) until they re-rendezvous.
    for n in survivors:
        sim.report("j", n, world_size=6)
    sim.step()
    assert sim.phase("j") == JobPhase.RESCALING
    for n in survivors:
        sim.report("j", n)  # 2 nodes x 2 processes
    sim.step()
    assert sim.phase("j") == JobPhase.RUNNING
    assert sim.reasons("j")[-1] == EventReason.RESTARTED
    assert sim.step() == []


@pytest.mark.parametrize(("path", "reason"), [
    ("live", EventReason.RESIZED_LIVE),
    ("restart (not_capable)", EventReason.RESTARTED),
])
def test_a_resize_says_resizing_then_how_it_went_on_the_nodes_that_stayed(
    path: str, reason: EventReason
) -> None:
    sim = cluster(1, 1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=3))
    sim.kill("n3")
    running(sim, "j")
    sim.join(make_node("n3"))
    [change] = sim.step()
    phased = [e for e in change.events if e.phase == JobPhase.RESCALING]
    assert [(e.reason, e.message) for e in phased][-1] == (EventReason.RESIZING,
                                                             "resizing to 3 node(s)")
    assert EventReason.RESTARTED not in [e.reason for e in change.events]  # not known yet
    for node in ("n1", "n2"):  # the joiner starts fresh: it says nothing
        sim.report("j", node, last_resize=path)
    sim.report("j", "n3")
    [change] = sim.step()
    assert sim.phase("j") == JobPhase.RUNNING
    assert [(e.reason, e.message) for e in change.events] == [(reason, "running at world size 3")]


def test_a_job_below_its_minimum_is_pending_and_runs_again_when_a_node_returns() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    running(sim, "j")
    sim.kill("n2")
    sim.step()
    assert sim.phase("j") == JobPhase.PENDING
    assert sim.reasons("j")[-2:] == [EventReason.NODE_LOST, EventReason.BELOW_MIN_NODES]
    assert condition(sim, "j", "Running") == (False, EventReason.BELOW_MIN_NODES.value)
    # Documented: a survivor keeps its assignment while the job waits; its
    # agent waits in the rendezvous for the minimum.
    assert sim.placed("j") == {"n1"}
    assert sim.settle() == 0
    sim.join(make_node("n2"))
    sim.step()
    assert sim.placed("j") == {"n1", "n2"}
    assert sim.phase("j") == JobPhase.RESCALING  # it ran before: a restart from checkpoint
    running(sim, "j")


def test_a_survivor_below_the_minimum_gets_no_partial_gang() -> None:
    sim = cluster(1, 1, 1)
    sim.submit(make_job("j", min_nodes=3, max_nodes=3))
    running(sim, "j")
    sim.kill("n2", "n3")
    sim.step()
    sim.join(make_node("n4"))  # one node back: still one short of the minimum
    assert sim.step() == []
    assert sim.placed("j") == {"n1"}
    sim.join(make_node("n5"))
    sim.step()
    assert sim.placed("j") == {"n1", "n4", "n5"}


def test_a_drained_node_loses_its_assignments_and_gets_no_new_ones() -> None:
    sim = cluster(2, 1, 1)
    sim.submit(make_job("a", min_nodes=1, max_nodes=2))
    sim.submit(make_job("b", min_nodes=1, max_nodes=1, created=1))
    running(sim, "a", "b")
    assert "n1" in sim.placed("a") and "n1" in sim.placed("b")
    sim.drain("n1")
    changes = {c.job_id: c for c in sim.step()}
    for job_id in ("a", "b"):
        assert "n1" in changes[job_id].delete
        assert EventReason.NODE_DRAINED in [e.reason for e in changes[job_id].events]
        assert sim.job(job_id).restarts["node_drained"] == 1
    sim.settle()
    assert "n1" not in sim.placed("a") | sim.placed("b")
    assert len(sim.placed("a")) == len(sim.placed("b")) == 1  # moved to n2 and n3
    sim.undrain("n1")
    sim.settle()
    assert "n1" in sim.placed("a")


def test_a_node_whose_runner_left_is_released_and_offered_again_on_a_later_pass() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    old = sim.assignment("j", "n2")
    sim.report("j", "n2", JobNodeState.CANCELLED)
    [change] = sim.step()  # apply() fails if it deletes and puts n2 in one transaction
    assert change.delete == ["n2"]
    assert "n2" not in change.put
    assert EventReason.NODE_LOST in [e.reason for e in change.events]
    assert sim.phase("j") == JobPhase.RESCALING
    sim.step()  # its report now belongs to no assignment: the node is free again
    assert sim.assignment("j", "n2").generation > old.generation
    running(sim, "j")


def test_slots_freed_by_a_cancel_are_given_out_in_the_same_pass() -> None:
    """Documented: the cancelled job's workers may still be stopping (up to its
    grace period) when the next job's start on the same node; the scheduler
    counts a node's slots by assignments, not by processes still exiting."""
    sim = cluster(1)
    sim.submit(make_job("a"))
    running(sim, "a")
    sim.submit(make_job("b", created=1))
    sim.cancel("a")
    changes = {c.job_id: c for c in sim.step()}
    assert changes["a"].delete == ["n1"]
    assert set(changes["b"].put) == {"n1"}


# PATCH -----------------------------------------------------------------------------------


def test_lowering_max_releases_the_newest_nodes_and_rewrites_the_rest_in_place() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=4))
    running(sim, "j")
    sim.join(make_node("n3"), make_node("n4"))
    running(sim, "j")
    old = {n: sim.assignment("j", n) for n in sim.placed("j")}
    newest = sorted(old, key=lambda n: old[n].generation)[-2:]
    assert set(newest) == {"n3", "n4"}
    sim.patch("j", max_nodes=2)
    [change] = sim.step()
    assert sorted(change.delete) == newest
    # The others keep their generation (their runners go on) with the new bounds.
    assert change.put == {n: old[n].model_copy(update={"max_nodes": 2}) for n in ("n1", "n2")}
    [scaled] = [e for e in change.events if e.reason == EventReason.SCALED_BY_USER]
    assert scaled.nodes == newest and "released n3, n4" in scaled.message
    assert sim.phase("j") == JobPhase.RESCALING  # the membership changed
    assert sim.job("j").restarts["scaled_by_user"] == 1
    running(sim, "j")
    assert sim.placed("j") == {"n1", "n2"}
    assert sim.job("j").nodes == {n: old[n].generation for n in ("n1", "n2")}


def test_new_bounds_that_change_no_membership_rewrite_the_assignments_in_place() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    running(sim, "j")
    for node in ("n1", "n2"):
        sim.report("j", node, last_step=7)
    sim.step()
    assert condition(sim, "j", "Training")[0]
    old = {n: sim.assignment("j", n) for n in sim.placed("j")}
    before = sim.job("j")
    sim.patch("j", min_nodes=1, max_nodes=4)  # nowhere to grow: n1 and n2 are full
    [change] = sim.step()
    assert change.delete == []
    assert change.put == {n: a.model_copy(update={"min_nodes": 1, "max_nodes": 4})
                          for n, a in old.items()}
    after = sim.job("j")
    assert after.nodes == before.nodes  # same generations: no agent restarts a runner
    assert after.restarts == before.restarts
    assert after.phase == JobPhase.RUNNING
    assert condition(sim, "j", "Running")[0] and condition(sim, "j", "Training")[0]
    [scaled] = [e for e in change.events if e.reason == EventReason.SCALED_BY_USER]
    assert scaled.nodes == [] and "nothing restarts" in scaled.message
    assert sim.step() == []  # level-triggered: done once
    sim.join(make_node("n3"))  # the new maximum takes effect: the job grows
    sim.step()
    assert sim.placed("j") == {"n1", "n2", "n3"}
    assert sim.assignment("j", "n3").max_nodes == 4
    assert {sim.assignment("j", n).generation for n in old} == {a.generation for a in old.values()}


def test_a_minimum_raised_above_the_nodes_restarts_them_to_wait_for_it() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=4))
    running(sim, "j")
    old = {n: sim.assignment("j", n).generation for n in sim.placed("j")}
    sim.patch("j", min_nodes=3)
    [change] = sim.step()
    # Written in place, the runners would train on below the minimum: they
    # restart instead, and wait in the rendezvous for a third node.
    assert all(change.put[n].generation > old[n] for n in old)
    assert sim.phase("j") == JobPhase.PENDING
    assert sim.job("j").restarts["scaled_by_user"] == 1
    [scaled] = [e for e in change.events if e.reason == EventReason.SCALED_BY_USER]
    assert scaled.message == "bounds now 3..4 nodes; 2 node(s) restart to wait for 3"


def test_a_minimum_raised_to_what_free_nodes_make_up_restarts_nothing() -> None:
    sim = cluster(1, 1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    old = {n: sim.assignment("j", n) for n in sim.placed("j")}
    sim.patch("j", min_nodes=3, max_nodes=3)
    [change] = sim.step()
    assert {n: change.put[n] for n in old} == {
        n: a.model_copy(update={"min_nodes": 3, "max_nodes": 3}) for n, a in old.items()}
    assert sim.placed("j") == {"n1", "n2", "n3"}  # the third joins the two that go on
    assert "scaled_by_user" not in sim.job("j").restarts
    assert [(e.reason, e.message) for e in change.events][:2] == [
        (EventReason.SCALED_BY_USER, "bounds now 3..3 nodes; the running nodes keep their runners"),
        (EventReason.NODE_JOINED, "node(s) n3 joined")]
    running(sim, "j")


def test_raising_min_above_the_live_count_makes_the_job_pending() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=4))
    running(sim, "j")
    sim.patch("j", min_nodes=3)
    sim.step()
    assert sim.phase("j") == JobPhase.PENDING
    assert sim.reasons("j")[-1] == EventReason.BELOW_MIN_NODES
    assert all(sim.assignment("j", n).min_nodes == 3 for n in sim.placed("j"))
    sim.join(make_node("n3"))
    sim.step()
    assert sim.placed("j") == {"n1", "n2", "n3"}
    assert sim.phase("j") == JobPhase.RESCALING
    running(sim, "j")


def test_raising_max_lets_a_running_job_grow() -> None:
    sim = cluster(1, 1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=1))
    running(sim, "j")
    sim.patch("j", max_nodes=3)
    sim.step()
    assert len(sim.placed("j")) == 3
    assert all(sim.assignment("j", n).max_nodes == 3 for n in sim.placed("j"))
    running(sim, "j")


# the end of a job ------------------------------------------------------------------------


def test_a_cancelled_job_ends_cancelled_and_loses_all_its_assignments() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    sim.cancel("j")
    [change] = sim.step()
    assert sorted(change.delete) == ["n1", "n2"] and change.put == {}
    record = sim.job("j")
    assert record.phase == JobPhase.CANCELLED
    assert record.exit_reason == ExitReason.CANCELLED
    assert record.finished_at == change.events[-1].time
    assert record.nodes == {}
    assert condition(sim, "j", "Finished") == (True, EventReason.CANCELLED.value)
    assert sim.placed("j") == set()


def test_a_pending_job_can_be_cancelled() -> None:
    sim = cluster(1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    sim.step()
    sim.cancel("j")
    sim.step()
    assert sim.phase("j") == JobPhase.CANCELLED
    assert sim.reasons("j")[-1] == EventReason.CANCELLED


def test_a_success_reported_at_the_current_generation_ends_the_job_succeeded() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    running(sim, "j")
    sim.report("j", "n1", JobNodeState.SUCCEEDED)
    sim.step()
    assert sim.phase("j") == JobPhase.SUCCEEDED
    assert sim.job("j").exit_reason == ExitReason.SUCCEEDED
    assert sim.placed("j") == set()


def test_a_failure_ends_the_job_failed_with_the_first_error_copied() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    running(sim, "j")
    first = WorkerError(rank=1, exit_code=3, message="CUDA out of memory")
    sim.report("j", "n2", JobNodeState.FAILED, error=WorkerError(rank=0, exit_code=9), at=5)
    sim.report("j", "n1", JobNodeState.FAILED, error=first, at=1)
    [change] = sim.step()
    record = sim.job("j")
    assert record.phase == JobPhase.FAILED
    assert record.exit_reason == ExitReason.WORKER_FAILED
    assert record.error == first
    assert "exit code 3" in change.events[-1].message
    assert sim.placed("j") == set()


def test_a_cancel_wins_over_reports_and_a_success_over_a_failure() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=2, max_nodes=2))
    running(sim, "j")
    sim.report("j", "n1", JobNodeState.SUCCEEDED)
    sim.report("j", "n2", JobNodeState.FAILED, error=WorkerError(rank=1, exit_code=1))
    [probe] = plan(sim.view, sim.clock)
    assert probe.record.phase == JobPhase.SUCCEEDED
    sim.cancel("j")
    sim.step()
    assert sim.phase("j") == JobPhase.CANCELLED
    assert sim.job("j").error is None


@pytest.mark.parametrize("state", [JobNodeState.SUCCEEDED, JobNodeState.FAILED,
                                   JobNodeState.CANCELLED])
def test_a_report_for_an_older_generation_is_ignored(state: JobNodeState) -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    old = sim.assignment("j", "n1").generation
    sim.drain("n1")  # n1 leaves the job, and comes back at a new generation
    sim.step()
    sim.undrain("n1")
    sim.step()
    assert sim.assignment("j", "n1").generation > old
    # The runner of the old generation ends (stopped, or it had just finished):
    # its last word is about a generation no longer in force.
    sim.report("j", "n1", state, generation=old)
    for change in (sim.step(), sim.step()):
        assert all(c.delete == [] for c in change)
    assert sim.phase("j") == JobPhase.RESCALING
    assert sim.placed("j") == {"n1", "n2"}
    running(sim, "j")


def test_a_report_from_a_node_no_longer_assigned_is_ignored() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    gone = sim.assignment("j", "n2").generation
    sim.kill("n2")
    sim.step()
    sim.report("j", "n2", JobNodeState.SUCCEEDED, generation=gone)  # the agent's last word
    sim.report("j", "n1")
    sim.step()
    assert sim.phase("j") == JobPhase.RUNNING


def test_a_finished_job_with_leftover_assignments_gets_them_deleted() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    record = sim.job("j").model_copy(update={"phase": JobPhase.SUCCEEDED})
    sim._put_job(record)  # as if a pass had died between writing the record and the rest
    [change] = sim.step()
    assert sorted(change.delete) == ["n1", "n2"]
    assert change.record == record and change.events == []
    assert sim.step() == []


@pytest.mark.parametrize("end", [JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED])
def test_a_finished_job_never_changes_again(end: JobPhase) -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    running(sim, "j")
    if end == JobPhase.CANCELLED:
        sim.cancel("j")
    else:
        state = JobNodeState.SUCCEEDED if end == JobPhase.SUCCEEDED else JobNodeState.FAILED
        sim.report("j", "n1", state)
    sim.step()
    finished = sim.job("j")
    assert finished.phase == end
    # Whatever happens next, nothing is written for it again.
    sim.join(make_node("n3"), make_node("n4"))
    sim.kill("n1")
    sim.report("j", "n2", JobNodeState.FAILED, generation=finished.next_generation)
    sim._put_job(finished.model_copy(update={"cancel_requested": True}))
    for _ in range(3):
        assert all(c.job_id != "j" for c in sim.step())
    assert sim.job("j").phase == end and sim.placed("j") == set()


# level-triggered -------------------------------------------------------------------------


def _busy_cluster() -> Sim:
    sim = cluster(2, 1, 1, 2, n4={"gpu": "h100"})
    sim.submit(make_job("a", min_nodes=2, max_nodes=3, priority=1))
    sim.submit(make_job("b", min_nodes=1, max_nodes=2, nproc=2, created=1))
    sim.submit(make_job("c", min_nodes=1, max_nodes=1, selector={"gpu": "h100"}, created=2))
    sim.submit(make_job("d", min_nodes=4, max_nodes=4, created=3))
    return sim


def test_a_settled_cluster_is_a_fixed_point() -> None:
    sim = _busy_cluster()
    sim.settle()
    assert sim.plan() == []
    sim.kill("n2")
    sim.settle()
    assert sim.plan() == []


def test_the_same_view_gives_the_same_plan() -> None:
    sim = _busy_cluster()
    for _ in range(3):
        first = plan(sim.view, sim.clock)
        again = plan(sim.view, sim.clock)
        assert first == again
        sim.step()
        sim.kill(*sorted(sim.view.nodes)[:1])


def test_the_changes_come_highest_priority_first() -> None:
    sim = cluster(1, 1)
    sim.submit(make_job("low", min_nodes=1, max_nodes=1, priority=0))
    running(sim, "low")
    sim.submit(make_job("high", min_nodes=1, max_nodes=1, priority=9, created=5))
    sim.kill(*sim.placed("low"))  # low loses its node while high is placed
    changes = sim.plan()
    assert [c.job_id for c in changes] == ["high", "low"]


def test_planning_does_not_touch_the_view() -> None:
    sim = _busy_cluster()
    sim.settle()
    sim.kill("n1")
    sim.cancel("c")
    before = ClusterView(
        jobs={k: v.model_copy(deep=True) for k, v in sim.view.jobs.items()},
        nodes=dict(sim.view.nodes),
        draining=sim.view.draining,
        assignments={k: dict(v) for k, v in sim.view.assignments.items()},
        statuses={k: dict(v) for k, v in sim.view.statuses.items()},
    )
    assert sim.plan()
    assert sim.view == before


def test_events_are_stamped_with_the_time_the_pass_was_given() -> None:
    sim = cluster(1)
    sim.submit(make_job("j"))
    later = sim.clock + timedelta(hours=1)
    [change] = plan(sim.view, later)
    assert {e.time for e in change.events} == {later}
    assert change.record.started_at == later
    assert {c.last_transition_time for c in change.record.conditions} == {later}
