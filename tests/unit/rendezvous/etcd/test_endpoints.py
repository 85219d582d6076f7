"""Which etcd endpoint the client's next call goes to (EndpointPicker; no etcd needed)."""

from __future__ import annotations

import pytest

from rendezvous.etcd import (
    MAX_QUARANTINE_S,
    REFUSED_QUARANTINE_S,
    SILENT_QUARANTINE_S,
    EndpointPicker,
)

A, B, C = "10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def picker(clock: Clock) -> EndpointPicker:
    return EndpointPicker([A, B, C], first=A, clock=clock)


def test_calls_stay_on_the_current_endpoint_while_it_answers(picker: EndpointPicker) -> None:
    assert [picker.pick() for _ in range(5)] == [A] * 5


def test_a_silent_endpoint_is_left_for_the_next_one_and_kept_away_from(
    picker: EndpointPicker, clock: Clock
) -> None:
    picker.failed(A, silent=True)
    assert picker.pick() == B
    assert picker.quarantined_for(A) == SILENT_QUARANTINE_S
    clock.now += SILENT_QUARANTINE_S - 0.1
    picker.failed(B, silent=True)
    assert picker.pick() == C  # A is still quarantined: not back to it


def test_an_endpoint_that_stays_silent_is_kept_away_longer_up_to_a_limit(
    picker: EndpointPicker, clock: Clock
) -> None:
    seen = []
    for _ in range(6):
        picker.failed(A, silent=True)
        seen.append(picker.quarantined_for(A))
        clock.now += seen[-1]
    assert seen == [10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert seen[-1] == MAX_QUARANTINE_S


def test_a_refusing_endpoint_is_tried_again_soon(picker: EndpointPicker, clock: Clock) -> None:
    picker.failed(A, silent=False)
    assert picker.quarantined_for(A) == REFUSED_QUARANTINE_S
    assert picker.pick() == B
    clock.now += REFUSED_QUARANTINE_S
    assert picker.quarantined_for(A) == 0.0
    assert picker.pick() == B  # calls stick to B, which answers


def test_the_endpoint_a_failed_call_went_to_is_blamed_not_the_current_one(
    picker: EndpointPicker,
) -> None:
    # Two threads were on A; the first failure moved calls to B. The second
    # failure, of the call that went to A, must not drive calls away from B.
    picker.failed(A, silent=True)
    assert picker.pick() == B
    picker.failed(A, silent=True)
    assert picker.pick() == B
    assert picker.quarantined_for(B) == 0.0


def test_an_answer_clears_the_quarantine_and_the_silences(
    picker: EndpointPicker, clock: Clock
) -> None:
    picker.failed(A, silent=True)
    picker.failed(A, silent=True)
    picker.answered(A)
    assert picker.quarantined_for(A) == 0.0
    picker.failed(A, silent=True)
    assert picker.quarantined_for(A) == SILENT_QUARANTINE_S  # counting starts over


def test_with_every_endpoint_quarantined_the_first_to_come_back_is_tried(
    picker: EndpointPicker, clock: Clock
) -> None:
    picker.failed(A, silent=True)
    clock.now += 1
    picker.failed(B, silent=False)  # back first: 2 s
    picker.failed(C, silent=True)
    assert picker.pick() == B  # never refuses to try


def test_a_single_endpoint_is_never_quarantined(clock: Clock) -> None:
    picker = EndpointPicker([A], clock=clock)
    picker.failed(A, silent=True)
    assert picker.quarantined_for(A) == 0.0
    assert picker.pick() == A


def test_failover_walks_the_endpoints_in_order_from_the_current_one(clock: Clock) -> None:
    picker = EndpointPicker([A, B, C], first=B, clock=clock)
    picker.failed(B, silent=False)
    assert picker.pick() == C
    picker.failed(C, silent=False)
    assert picker.pick() == A


def test_unknown_endpoints_are_refused_or_ignored(clock: Clock) -> None:
    with pytest.raises(ValueError, match="at least one endpoint"):
        EndpointPicker([], clock=clock)
    with pytest.raises(ValueError, match="is not one of"):
        EndpointPicker([A, B], first=C, clock=clock)
    picker = EndpointPicker([A, B], clock=clock)
    picker.failed(C, silent=True)  # a stale name: nothing happens
    picker.answered(C)
    assert picker.pick() == A
