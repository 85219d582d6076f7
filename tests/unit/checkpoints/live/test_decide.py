"""The live resize's decisions at a step boundary (checkpoints.live.decide): the sync source,
whether a notice is pending, and continue, resize or leave."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoints.live import (
    HOST_WAIT_S,
    JOINER_WAIT_S,
    Action,
    Flags,
    ResizeNotice,
    choose_source,
    decide,
    pending_flags,
    pending_round,
)
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


def flags(n: ResizeNotice | None, *, current: int = 2, world_size: int = 3, hosting: bool = False,
          waiting: bool = False, host_said: int = 0, waited: float = 0.0) -> Flags:
    return pending_flags(n, current, world_size=world_size, hosting=hosting,
                         joiners_waiting=waiting, host_said=host_said, waited_s=waited)


def test_a_notice_that_does_not_grow_the_group_is_acted_on_at_once() -> None:
    assert flags(None) == (0, 0)
    assert flags(notice(3, world_size=3)) == (3, 0)  # a join and a leave at once
    assert flags(notice(3, world_size=2), hosting=True) == (3, 0)  # a leave
    assert flags(notice(3, world_size=4, lost=True)) == (3, 0)  # a recovery never waits
    assert flags(notice(2, world_size=4)) == (0, 0)  # acted on already


def test_a_growing_group_trains_on_until_its_host_sees_the_joiners_wait() -> None:
    grows = notice(3, world_size=4)
    assert flags(grows, hosting=True) == (0, 3)  # says it hosts round 3, not yet
    assert flags(grows, hosting=True, waiting=True) == (3, 3)
    assert flags(grows, hosting=True, waited=JOINER_WAIT_S) == (3, 3)  # bounded
    # The others follow the host once it said so, bounded too.
    assert flags(grows, host_said=3, waited=HOST_WAIT_S + 1) == (0, 0)
    assert flags(grows, host_said=3, waited=JOINER_WAIT_S) == (3, 0)


def test_where_no_rank_of_the_old_group_hosts_the_new_one_they_act_after_a_moment() -> None:
    grows = notice(3, world_size=4)
    assert flags(grows) == (0, 0)  # the host may not have seen its notice yet
    assert flags(grows, host_said=2, waited=HOST_WAIT_S) == (3, 0)  # an older round's host
    assert flags(grows, waited=HOST_WAIT_S) == (3, 0)


@given(st.integers(1, 9), st.integers(0, 9), st.integers(1, 16), st.integers(1, 16),
       st.booleans(), st.booleans(), st.booleans(), st.integers(0, 9),
       st.floats(0, 2 * JOINER_WAIT_S))
def test_a_rank_never_acts_on_a_round_it_has_no_pending_notice_of_and_always_acts_in_time(
    round_: int, current: int, old: int, new: int, lost: bool, hosting: bool, waiting: bool,
    host_said: int, waited: float,
) -> None:
    n = notice(round_, world_size=new, lost=lost)
    go, host = flags(n, current=current, world_size=old, hosting=hosting, waiting=waiting,
                     host_said=host_said, waited=waited)
    assert go in (0, pending_round(n, current)) and host in (0, pending_round(n, current))
    if waited >= JOINER_WAIT_S:
        assert go == pending_round(n, current)  # no joiner is waited for longer than that
    if host:
        assert hosting and new > old and not lost
