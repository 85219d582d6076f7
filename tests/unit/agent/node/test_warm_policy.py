"""When the daemon keeps a warm runner ready, starts, forgets and replaces it
(agent.node.warm_policy)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.node.warm_policy import (
    WARM_REFILL_DELAY_S,
    WARM_RETRY_MAX_S,
    WARM_RETRY_S,
    WarmState,
    WarmStep,
    WarmTimer,
    wants_warm_runner,
    warm_step,
)
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


# warm_step and WarmTimer ------------------------------------------------------------


def step(state: WarmState, *, now: float = 100.0, timer: WarmTimer | None = None,
         wanted: bool = True, stopping: bool = False) -> WarmStep:
    return warm_step(state, now=now, timer=timer or WarmTimer(), wanted=wanted,
                     stopping=stopping)


def test_one_is_started_when_there_is_none_it_is_wanted_and_time() -> None:
    assert step(WarmState.NONE) == WarmStep.SPAWN
    assert step(WarmState.NONE, wanted=False) == WarmStep.WAIT
    assert step(WarmState.NONE, stopping=True) == WarmStep.WAIT
    assert step(WarmState.NONE, timer=WarmTimer(due=100.5)) == WarmStep.WAIT


def test_one_waiting_for_a_job_is_kept_even_when_none_is_wanted_any_more() -> None:
    assert step(WarmState.WAITING) == WarmStep.WAIT
    assert step(WarmState.WAITING, wanted=False, stopping=True) == WarmStep.WAIT


def test_one_that_exited_on_its_own_is_forgotten_and_replaced_later_each_time_later() -> None:
    assert step(WarmState.EXITED, wanted=False) == WarmStep.FORGET
    timer = WarmTimer().died(100.0)
    assert timer == WarmTimer(due=100.0 + WARM_RETRY_S, retry_s=2 * WARM_RETRY_S)
    assert step(WarmState.NONE, now=100.0 + WARM_RETRY_S - 1, timer=timer) == WarmStep.WAIT
    assert step(WarmState.NONE, now=100.0 + WARM_RETRY_S, timer=timer) == WarmStep.SPAWN
    for _ in range(10):
        timer = timer.died(0.0)
    assert timer.retry_s == WARM_RETRY_MAX_S


def test_the_next_one_starts_a_while_after_one_is_taken() -> None:
    timer = WarmTimer(retry_s=120.0).taken(50.0, handed=True)
    assert timer == WarmTimer(due=50.0 + WARM_REFILL_DELAY_S, retry_s=WARM_RETRY_S)
    assert step(WarmState.NONE, now=50.0 + WARM_REFILL_DELAY_S - 1, timer=timer) == WarmStep.WAIT
    # One found gone when a job came proves nothing: its retry delay stays.
    assert WarmTimer(retry_s=120.0).taken(50.0, handed=False).retry_s == 120.0


def test_a_runner_stopped_for_its_next_generation_wants_a_warm_successor_at_once() -> None:
    timer = WarmTimer(due=1000.0, retry_s=60.0).successor_wanted()
    assert timer == WarmTimer(due=0.0, retry_s=60.0)
    assert step(WarmState.NONE, now=5.0, timer=timer) == WarmStep.SPAWN


events = st.lists(st.tuples(st.sampled_from(["died", "handed", "gone", "successor", "wait"]),
                            st.floats(0.0, 100.0)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(events)
def test_the_timer_never_waits_longer_than_its_cap_nor_retries_sooner_than_its_floor(
    script: list[tuple[str, float]],
) -> None:
    now, timer = 0.0, WarmTimer()
    for event, elapsed in script:
        now += elapsed
        if event == "died":
            timer = timer.died(now)
        elif event in ("handed", "gone"):
            timer = timer.taken(now, handed=event == "handed")
        elif event == "successor":
            timer = timer.successor_wanted()
        assert WARM_RETRY_S <= timer.retry_s <= WARM_RETRY_MAX_S
        assert timer.due <= now + WARM_RETRY_MAX_S
        # A warm runner is never started beside one that waits for a job, and one
        # that exited is forgotten before another starts.
        assert step(WarmState.WAITING, now=now, timer=timer) == WarmStep.WAIT
        assert step(WarmState.EXITED, now=now, timer=timer) == WarmStep.FORGET
