"""`tidal up`'s supervisor: when a dead coordinator or agent starts again (a pure decision)."""

from __future__ import annotations

from service.up.cluster import RestartPolicy


def test_first_restart_comes_after_the_base_delay() -> None:
    policy = RestartPolicy(base_s=0.5, max_s=30, stable_s=60)
    assert policy.next_delay(quick_deaths=0, ran_s=1.0) == (0.5, 1)


def test_each_quick_death_doubles_the_delay_up_to_the_cap() -> None:
    policy = RestartPolicy(base_s=0.5, max_s=30, stable_s=60)
    deaths, delays = 0, []
    for _ in range(10):
        delay, deaths = policy.next_delay(quick_deaths=deaths, ran_s=0.1)
        delays.append(delay)
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert deaths == 10


def test_a_child_that_ran_long_enough_starts_the_count_again() -> None:
    policy = RestartPolicy(base_s=0.5, max_s=30, stable_s=60)
    assert policy.next_delay(quick_deaths=7, ran_s=60.0) == (0.5, 1)
    assert policy.next_delay(quick_deaths=7, ran_s=59.9) == (30, 8)


def test_a_child_dying_for_ever_restarts_at_a_bounded_rate() -> None:
    """However many deaths, the supervisor never starts one child more often than max_s."""
    policy = RestartPolicy(base_s=0.5, max_s=30, stable_s=60)
    delay, _ = policy.next_delay(quick_deaths=10_000, ran_s=0.0)
    assert delay == 30
