"""When the daemon keeps a warm runner ready (agent.daemon.wants_warm_runner)."""

from __future__ import annotations

from agent.daemon import wants_warm_runner
from rendezvous.records import Assignment


def job(job_id: str, *, nproc: int = 1, max_restarts: int = 3) -> Assignment:
    return Assignment(job_id=job_id, command=["python", "-c", "pass"], min_nodes=1,
                      max_nodes=1, nproc_per_node=nproc, max_restarts=max_restarts)


def test_an_idle_node_keeps_one_for_the_next_job() -> None:
    assert wants_warm_runner(1, [])
    assert wants_warm_runner(4, [(job("a", nproc=2, max_restarts=0), False)])


def test_a_full_node_keeps_one_as_the_spare_of_a_runner_that_may_die() -> None:
    assert wants_warm_runner(1, [(job("a"), False)])
    assert wants_warm_runner(2, [(job("a", max_restarts=0), False), (job("b"), False)])


def test_a_full_node_whose_jobs_cannot_restart_keeps_none() -> None:
    assert not wants_warm_runner(1, [(job("a", max_restarts=0), False)])
    assert not wants_warm_runner(2, [(job("a", nproc=2, max_restarts=0), False)])


def test_a_stopping_runner_frees_its_slots_for_its_successor() -> None:
    # A new generation (new bounds) of a job that cannot restart: its next
    # runner is wanted as soon as the old one has left.
    assert wants_warm_runner(1, [(job("a", max_restarts=0), True)])
    # A stopping runner is nobody's spare to be.
    assert not wants_warm_runner(
        2, [(job("a", max_restarts=0), False), (job("b", max_restarts=5), True),
            (job("c", max_restarts=0), False)],
    )
