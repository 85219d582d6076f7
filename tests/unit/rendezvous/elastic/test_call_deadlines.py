"""Deadlines of the rendezvous backend's liveness-critical calls (no etcd needed)."""

from __future__ import annotations

import pytest

from rendezvous.elastic.etcd_v3 import DEFAULT_RDZV_CONF, MIN_CALL_TIMEOUT_S, liveness_call_timeout
from rendezvous.elastic.store import ride_out_outage
from rendezvous.errors import EtcdAuthError, EtcdUnavailableError


def test_tidals_default_liveness_window_gives_state_calls_one_second() -> None:
    window = (int(DEFAULT_RDZV_CONF["keep_alive_interval"]),
              int(DEFAULT_RDZV_CONF["keep_alive_max_attempt"]))
    assert liveness_call_timeout(*window, etcd_timeout_s=10.0) == 1.0


def test_the_deadline_is_a_fifth_of_the_window_within_bounds() -> None:
    assert liveness_call_timeout(5, 3, etcd_timeout_s=10.0) == 3.0  # torch's defaults
    assert liveness_call_timeout(1, 1, etcd_timeout_s=10.0) == MIN_CALL_TIMEOUT_S
    assert liveness_call_timeout(60, 10, etcd_timeout_s=10.0) == 10.0  # never the client's


def test_each_retry_gets_twice_the_previous_deadline() -> None:
    deadlines: list[float | None] = []

    def call(timeout_s: float | None) -> str:
        deadlines.append(timeout_s)
        if len(deadlines) < 4:
            raise EtcdUnavailableError("no answer")
        return "done"

    assert ride_out_outage("a test", call, grace_s=30, call_timeout_s=0.5) == "done"
    assert deadlines == [0.5, 1.0, 2.0, 4.0]


def test_without_a_deadline_every_attempt_uses_the_clients() -> None:
    deadlines: list[float | None] = []

    def call(timeout_s: float | None) -> str:
        deadlines.append(timeout_s)
        if len(deadlines) < 2:
            raise EtcdUnavailableError("no answer")
        return "done"

    assert ride_out_outage("a test", call, grace_s=30) == "done"
    assert deadlines == [None, None]


def test_errors_other_than_unavailability_are_not_retried() -> None:
    calls = []

    def call(timeout_s: float | None) -> None:
        calls.append(timeout_s)
        raise EtcdAuthError("refused")

    with pytest.raises(EtcdAuthError):
        ride_out_outage("a test", call, grace_s=30, call_timeout_s=1.0)
    assert calls == [1.0]
