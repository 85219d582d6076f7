"""The runner's restart decisions (agent.runner.restarts): what a failure or a change
costs, what next."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.runner import live_decide as live
from agent.runner import restarts
from agent.runner.restarts import Action, Step
from agent.runner_metrics import MEMBERSHIP_CHANGED, NOT_CAPABLE, TIMEOUT, WORKER_EXITED
from rendezvous.elastic.assigned_rounds import CHANGE_KINDS, LEAVING, LOST, SUPERSEDED, WAITING
from rendezvous.records import RestartReason

AB, ABC, AC, ABD = (frozenset(s) for s in ("ab", "abc", "ac", "abd"))


def test_a_failure_with_the_same_members_is_charged_until_the_budget_is_spent() -> None:
    assert restarts.after_failure(2, AB, AB) == Step(
        Action.RESTART_CHARGED, 1, charged=True, broken=True, reason=RestartReason.WORKER_FAILED)
    assert restarts.after_failure(0, AB, AB) == Step(
        Action.FAIL, 0, broken=True, reason=RestartReason.WORKER_FAILED)
    # Before the first round there is nothing to compare: charged.
    assert restarts.after_failure(1, frozenset(), AB).action is Action.RESTART_CHARGED


@pytest.mark.parametrize(("new", "reason", "resize"), [
    (AB, RestartReason.NODE_LOST, "lost"),
    (frozenset("abcd"), RestartReason.NODE_JOINED, "join"),
    (ABD, RestartReason.MEMBERSHIP_CHANGED, "lost"),
])
def test_a_failure_after_which_the_members_changed_is_not_charged(
    new: frozenset[str], reason: RestartReason, resize: str
) -> None:
    for budget in (0, 3):
        assert restarts.after_failure(budget, ABC, new) == Step(
            Action.RESTART, budget, broken=True, reason=reason, resize=resize)


def blocked_by(cause: str | None) -> Callable[[], str | None]:
    return lambda: cause


def test_a_planned_change_goes_live_when_the_group_can_else_restarts_with_the_grace() -> None:
    assert restarts.for_change(WAITING, 2, blocked_by(None)) == Step(
        Action.LIVE, 2, resize="join")
    assert restarts.for_change(LEAVING, 2, blocked_by(NOT_CAPABLE)) == Step(
        Action.FALL_BACK, 2, resize="leave", fallback=NOT_CAPABLE)


def test_a_lost_member_is_recovered_in_place_when_the_workers_can() -> None:
    # The survivors keep their processes: the live path, not broken, not charged.
    assert restarts.for_change(LOST, 1, blocked_by(None)) == Step(
        Action.LIVE, 1, resize="lost")


def test_a_lost_member_the_workers_cannot_recover_from_restarts_a_broken_group_and_says_why(
) -> None:
    assert restarts.for_change(LOST, 1, blocked_by(NOT_CAPABLE)) == Step(
        Action.RESTART, 1, broken=True, resize="lost", fallback=NOT_CAPABLE)


def test_a_superseded_round_restarts_a_broken_group_without_asking_the_live_path() -> None:
    def never() -> str | None:
        raise AssertionError("a node the others went on without is fenced: no live path")

    assert restarts.for_change(SUPERSEDED, 1, never) == Step(
        Action.RESTART, 1, broken=True, resize="lost")


def test_the_live_path_is_done_or_falls_back_at_once_rejoining_if_superseded() -> None:
    assert restarts.after_live(WAITING, 1, live.DONE) == Step(Action.LIVE, 1, resize="join")
    assert restarts.after_live(LEAVING, 1, TIMEOUT) == Step(
        Action.FALL_BACK, 1, broken=True, resize="leave", fallback=TIMEOUT)
    assert restarts.after_live(WAITING, 1, MEMBERSHIP_CHANGED).rejoin
    assert not restarts.after_live(WAITING, 1, WORKER_EXITED).rejoin


def test_a_restart_for_a_change_counts_as_the_members_diff_says_else_as_its_kind() -> None:
    assert restarts.restart_reason(WAITING, AB, ABC) == RestartReason.NODE_JOINED
    assert restarts.restart_reason(WAITING, ABC, AC) == RestartReason.NODE_LOST
    assert restarts.restart_reason(WAITING, AB, AB) == RestartReason.NODE_JOINED
    assert restarts.restart_reason(LEAVING, AB, AB) == RestartReason.NODE_LOST
    assert restarts.restart_reason(LOST, ABC, ABD) == RestartReason.MEMBERSHIP_CHANGED


@pytest.mark.parametrize(("kind", "reason"), [
    (WAITING, "join"), (LEAVING, "leave"), (LOST, "lost"), (SUPERSEDED, "lost"),
])
def test_a_change_kind_names_its_resize_reason(kind: str, reason: str) -> None:
    assert restarts.resize_reason(kind) == reason


members = st.frozensets(st.sampled_from("abcd"))
outcomes = st.sampled_from([live.DONE, NOT_CAPABLE, TIMEOUT, WORKER_EXITED, MEMBERSHIP_CHANGED])


@given(st.integers(0, 5), members, members, st.sampled_from(CHANGE_KINDS),
       st.one_of(st.none(), st.just(NOT_CAPABLE)), outcomes)
def test_the_budget_never_goes_below_zero_a_change_is_never_charged_a_spent_one_fails(
    budget: int, old: frozenset[str], new: frozenset[str], kind: str, cause: str | None,
    outcome: str,
) -> None:
    failure = restarts.after_failure(budget, old, new)
    changed = restarts.membership_reason(old, new) is not None
    assert failure.budget >= 0
    assert failure.budget == budget - failure.charged
    assert failure.charged == (failure.action is Action.RESTART_CHARGED)
    if changed:
        assert not failure.charged and failure.action is Action.RESTART
    if budget == 0:
        assert failure.action is (Action.RESTART if changed else Action.FAIL)
    for step in (restarts.for_change(kind, budget, blocked_by(cause)),
                 restarts.after_live(kind, budget, outcome)):
        assert not step.charged and step.budget == budget
        assert step.action in (Action.LIVE, Action.FALL_BACK, Action.RESTART)
        assert step.resize == restarts.resize_reason(kind)
