"""Queues in the scheduler: guarantees, borrowing by weight, limits, reclaim and reservations.

Each test drives :func:`service.scheduler.plan` through the simulator, with
agents that report running, and says in its name what the scheduler must do.
"""

from __future__ import annotations

from datetime import timedelta

from rendezvous.records import JobNodeState
from service.api.models import EventReason, JobPhase
from service.scheduler import Policy
from tests.unit.service.scheduler.test_scheduler import cluster, condition, running
from tests.unit.service.sim import Sim, make_job


def two_teams(nodes: int = 3) -> Sim:
    """Queues a (guaranteed 2 slots) and b (guaranteed 1) on ``nodes`` one-slot nodes."""
    sim = cluster(*([1] * nodes))
    sim.set_queue("a", 2)
    sim.set_queue("b", 1)
    return sim


def events_of(sim: Sim, job_id: str, reason: EventReason) -> list[str]:
    return [e.message for e in sim.events.get(job_id, []) if e.reason == reason]


def test_an_elastic_job_borrows_the_idle_cluster_beyond_its_queues_guarantee() -> None:
    sim = two_teams()
    sim.submit(make_job("b1", min_nodes=1, max_nodes=3, queue="b"))
    running(sim, "b1")
    assert len(sim.placed("b1")) == 3


def test_a_waiting_guaranteed_job_shrinks_a_borrower_toward_its_minimum_then_starts() -> None:
    sim = two_teams()
    sim.submit(make_job("b1", min_nodes=1, max_nodes=3, queue="b"))
    running(sim, "b1")
    sim.submit(make_job("a1", min_nodes=2, max_nodes=2, queue="a", created=5))
    sim.report_running()
    sim.step()
    # The reclaiming pass only releases: the slots are held for a1, nobody else's.
    assert len(sim.placed("b1")) == 1 and not sim.placed("a1")
    [shrunk] = events_of(sim, "b1", EventReason.RECLAIMED)
    assert "shrunk from 3 to 1 node(s)" in shrunk and "a1 of queue a" in shrunk
    assert sim.job("b1").restarts == {"reclaimed": 1}
    assert sim.last is not None and [r.waiter for r in sim.last.reclaims] == ["a1"]
    sim.report_running()
    sim.step()  # the next pass: a1 starts on the room made
    assert len(sim.placed("a1")) == 2 and len(sim.placed("b1")) == 1
    running(sim, "a1", "b1")
    assert sim.placed("a1").isdisjoint(sim.placed("b1"))


def test_a_rigid_borrower_is_preempted_whole_and_resumes_when_room_returns() -> None:
    sim = two_teams()
    sim.submit(make_job("b1", min_nodes=3, max_nodes=3, queue="b"))
    running(sim, "b1")
    sim.submit(make_job("a1", min_nodes=2, queue="a", max_nodes=2, created=5))
    sim.report_running()
    sim.step()
    assert sim.phase("b1") == JobPhase.PENDING and not sim.placed("b1")
    [message] = events_of(sim, "b1", EventReason.PREEMPTED)
    assert "for job a1 of queue a" in message
    assert condition(sim, "b1", "Scheduled") == (False, "preempted")
    running(sim, "a1")
    assert sim.phase("b1") == JobPhase.PENDING  # 1 node free of the 3 it needs
    for node_id in sorted(sim.placed("a1")):
        sim.report("a1", node_id, JobNodeState.SUCCEEDED)
    sim.step()
    sim.settle()
    assert sim.phase("b1") == JobPhase.RUNNING and len(sim.placed("b1")) == 3
    assert EventReason.RESTARTED in sim.reasons("b1")  # from its checkpoint


def test_a_job_within_its_queues_guarantee_is_never_taken_from_for_another_queue() -> None:
    sim = two_teams()
    sim.submit(make_job("a1", min_nodes=2, max_nodes=2, queue="a"))  # a's guarantee
    sim.submit(make_job("a2", min_nodes=1, queue="a", priority=-1, created=1))  # borrowed
    running(sim, "a1", "a2")
    sim.submit(make_job("b1", min_nodes=1, queue="b", created=5))
    sim.settle()
    assert sim.phase("a1") == JobPhase.RUNNING and len(sim.placed("a1")) == 2
    assert sim.phase("a2") == JobPhase.PENDING
    assert sim.phase("b1") == JobPhase.RUNNING
    assert EventReason.PREEMPTED not in sim.reasons("a1")


def test_no_reclaim_for_a_queue_that_already_holds_its_guarantee() -> None:
    sim = two_teams()
    sim.submit(make_job("a1", min_nodes=1, max_nodes=3, queue="a"))
    running(sim, "a1")
    sim.submit(make_job("b1", min_nodes=1, queue="b", created=5))
    sim.submit(make_job("b2", min_nodes=1, queue="b", created=6))
    sim.settle()
    # b is owed one slot: a1 gives one back and keeps its guarantee of 2.
    assert len(sim.placed("a1")) == 2 and sim.placed("b1") and not sim.placed("b2")


def test_within_a_queue_a_higher_priority_job_preempts_a_lower_one() -> None:
    sim = cluster(1, 1)
    sim.set_queue("a", 2)
    sim.submit(make_job("low", min_nodes=2, max_nodes=2, queue="a"))
    running(sim, "low")
    sim.submit(make_job("high", min_nodes=1, queue="a", priority=5, created=5))
    sim.settle()
    assert sim.phase("high") == JobPhase.RUNNING and sim.phase("low") == JobPhase.PENDING
    [message] = events_of(sim, "low", EventReason.PREEMPTED)
    assert "of higher priority (5 > 0)" in message


def test_equal_priorities_in_a_queue_never_preempt_each_other() -> None:
    sim = cluster(1)
    sim.set_queue("a", 1)
    sim.submit(make_job("first", queue="a"))
    running(sim, "first")
    sim.submit(make_job("second", queue="a", created=5))
    sim.settle()
    assert sim.phase("first") == JobPhase.RUNNING and sim.phase("second") == JobPhase.PENDING


def test_a_queue_never_holds_more_than_its_limit() -> None:
    sim = cluster(1, 1, 1, 1)
    sim.set_queue("a", 1, limit=2)
    sim.submit(make_job("a1", min_nodes=1, max_nodes=4, queue="a"))
    sim.submit(make_job("a2", min_nodes=1, queue="a", created=1))
    running(sim, "a1")
    assert len(sim.placed("a1")) + len(sim.placed("a2")) == 2


def test_idle_slots_are_shared_between_queues_by_weight() -> None:
    sim = cluster(*([1] * 8))
    sim.set_queue("x", 0, weight=1)
    sim.set_queue("y", 0, weight=3)
    sim.submit(make_job("x1", min_nodes=1, max_nodes=8, queue="x"))
    sim.submit(make_job("y1", min_nodes=1, max_nodes=8, queue="y", created=1))
    running(sim, "x1", "y1")
    assert (len(sim.placed("x1")), len(sim.placed("y1"))) == (2, 6)


def test_a_job_of_an_unknown_queue_only_borrows() -> None:
    sim = cluster(1, 1)
    sim.set_queue("a", 1)
    sim.submit(make_job("orphan", min_nodes=1, max_nodes=2, queue="gone"))
    running(sim, "orphan")
    sim.submit(make_job("a1", queue="a", created=5))
    sim.settle()
    assert sim.phase("a1") == JobPhase.RUNNING and len(sim.placed("orphan")) == 1


def test_a_big_job_gets_a_reservation_and_small_jobs_stop_backfilling_its_nodes() -> None:
    sim = cluster(1, 1)
    sim.policy = Policy(reserve_after_s=30)
    sim.submit(make_job("small0", created=60))
    running(sim, "small0")
    sim.submit(make_job("big", min_nodes=2, max_nodes=2, priority=1, created=61))
    sim.submit(make_job("small1", created=62))
    sim.settle()
    assert sim.placed("small1"), "before its patience runs out, the big job is backfilled"
    sim.report("small1", next(iter(sim.placed("small1"))), JobNodeState.SUCCEEDED)
    sim.step()
    sim.clock += timedelta(seconds=40)
    sim.submit(make_job("small2", created=110))
    sim.settle()
    assert sim.last is not None
    assert not sim.placed("small2"), "the node freed is held for the big job"
    assert sim.phase("big") == JobPhase.PENDING
    sim.report("small0", next(iter(sim.placed("small0"))), JobNodeState.SUCCEEDED)
    sim.step()
    sim.settle()
    assert sim.phase("big") == JobPhase.RUNNING and not sim.placed("small2")


def test_without_queues_nothing_is_ever_preempted() -> None:
    sim = cluster(1)
    sim.submit(make_job("low", priority=-5))
    running(sim, "low")
    sim.submit(make_job("high", priority=5, created=5))
    sim.settle()
    assert sim.phase("low") == JobPhase.RUNNING and sim.phase("high") == JobPhase.PENDING
