"""The live resize's decisions at a step boundary (checkpoints.live.decide): the sync source,
whether a notice is pending, and continue, resize or leave."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoints.live import Action, choose_source, decide, pending_round
from tests.unit.checkpoints.protocol.test_live import notice


def test_the_source_is_the_lowest_rank_with_the_largest_step() -> None:
    assert choose_source([5, 5, -1]) == (0, 5)
    assert choose_source([-1, 7, 7]) == (1, 7)
    assert choose_source([-1, -1]) == (0, -1)  # nobody holds anything live
    assert choose_source([3]) == (0, 3)
    with pytest.raises(ValueError, match="no ranks"):
        choose_source([])


@given(st.lists(st.integers(min_value=-1, max_value=10**6), min_size=1, max_size=64))
def test_no_rank_before_the_source_holds_its_step_and_none_holds_more(steps: list[int]) -> None:
    source, step = choose_source(steps)
    assert steps[source] == step == max(steps)
    assert all(s < step for s in steps[:source])


def test_a_rank_flags_its_notice_until_it_acted_on_it() -> None:
    assert pending_round(None, 0) == 0
    assert pending_round(notice(3), 0) == 3
    assert pending_round(notice(3), 2) == 3
    assert pending_round(notice(3), 3) == 0  # resized into it already
    assert pending_round(notice(3), 4) == 0


@pytest.mark.parametrize(
    ("agreed", "current", "leaving", "notice_round", "action"),
    [
        (0, 0, False, None, Action.CONTINUE),  # nobody saw a notice
        (3, 3, False, 3, Action.CONTINUE),  # that round is this rank's already
        (2, 3, True, None, Action.CONTINUE),  # an older round: nothing to do
        (3, 0, False, 3, Action.RESIZE),
        (3, 2, False, 2, Action.RESIZE),  # its own notice is on its way
        (3, 2, False, None, Action.RESIZE),
        (4, 2, False, 5, Action.RESIZE),  # a newer notice already: take it
        (3, 2, True, None, Action.LEAVE),  # the node leaves: not in the new round
        (3, 2, True, 2, Action.LEAVE),  # an old notice does not keep it
        (3, 2, True, 3, Action.RESIZE),  # a notice of the round: it stays after all
    ],
)
def test_the_decision_at_a_boundary(
    agreed: int, current: int, leaving: bool, notice_round: int | None, action: Action
) -> None:
    got = decide(
        agreed_round=agreed, current_round=current, leaving=leaving, notice_round=notice_round
    )
    assert got is action
