"""The etcd facade's one call path: every call has a deadline; a request that never
reached a member goes once more to another; a watch that etcd does not confirm in time
ends (rendezvous.etcd.facade and .stream; no etcd needed).

The facade's transport is real (its gRPC channels connect lazily and are never
used); only its one sending method is replaced, by a recorder that answers
with etcd's own (empty) response messages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from pyetcd import etcdrpc

from rendezvous.errors import EtcdError, EtcdUnavailableError
from rendezvous.etcd import Compare, EtcdClient, EtcdConfig, Get, Put, WatchStream
from rendezvous.etcd.facade import AUTHENTICATE_TIMEOUT_S
from rendezvous.etcd.transport import Transport
from tests.unit.rendezvous.etcd.test_translate import RpcError

TIMEOUT_S = 3.0
A, B = "127.0.0.1:1", "127.0.0.1:2"

ANSWERS: dict[str, Callable[[], Any]] = {
    "Range": etcdrpc.RangeResponse,
    "Put": etcdrpc.PutResponse,
    "DeleteRange": etcdrpc.DeleteRangeResponse,
    "Txn": etcdrpc.TxnResponse,
    "Compact": etcdrpc.CompactionResponse,
    "LeaseGrant": lambda: etcdrpc.LeaseGrantResponse(ID=7, TTL=5),
    "LeaseRevoke": etcdrpc.LeaseRevokeResponse,
    "LeaseKeepAlive": lambda: iter([etcdrpc.LeaseKeepAliveResponse(ID=7, TTL=5)]),
    "LeaseTimeToLive": lambda: etcdrpc.LeaseTimeToLiveResponse(TTL=4),
    "Status": etcdrpc.StatusResponse,
}


class Recorder:
    """Stands in for ``Transport.call``: records (endpoint, method, deadline)."""

    def __init__(self, client: EtcdClient, *failures: grpc.RpcError) -> None:
        self.client = client
        self.failures = iter(failures)
        self.calls: list[tuple[str | None, str, float]] = []

    def __call__(self, stub: str, method: str, request: Any, timeout: float, **_: Any) -> Any:
        getattr(self.client._client, stub)  # picks the endpoint, as a real call does
        self.calls.append((self.client._client.used, method, timeout))
        failure = next(self.failures, None)
        if failure is not None:
            raise failure
        return ANSWERS[method]()


@pytest.fixture
def client() -> Iterator[EtcdClient]:
    with EtcdClient(EtcdConfig(endpoints=[A, B], timeout_s=TIMEOUT_S)) as etcd:
        yield etcd


@pytest.fixture
def record(client: EtcdClient, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Recorder]:
    """Puts a :class:`Recorder`, failing with the errors given first, in the transport."""

    def install(*failures: grpc.RpcError) -> Recorder:
        recorder = Recorder(client, *failures)
        monkeypatch.setattr(client._client, "call", recorder)
        return recorder

    return install


CALLS: dict[str, Callable[[EtcdClient], object]] = {
    "get": lambda c: c.get("/k"),
    "get_prefix": lambda c: c.get_prefix("/k/"),
    "count_prefix": lambda c: c.count_prefix("/k/"),
    "put": lambda c: c.put("/k", b"v"),
    "delete": lambda c: c.delete("/k"),
    "delete_prefix": lambda c: c.delete_prefix("/k/"),
    "txn": lambda c: c.txn([Compare("/k", "mod", "==", 1)], [Put("/k", b"v")], [Get("/k")]),
    "grant_lease": lambda c: c.grant_lease(5),
    "revoke_lease": lambda c: c.revoke_lease(7),
    "refresh_lease": lambda c: c.refresh_lease(7),
    "lease_ttl": lambda c: c.lease_ttl(7),
    "status": lambda c: c.status(),
    "compact": lambda c: c.compact(3),
}


def test_every_operation_of_the_facade_is_checked_here() -> None:
    operations = {n for n, v in vars(EtcdClient).items() if callable(v) and not n.startswith("_")}
    # close sends nothing; a watch is a stream whose opening has the deadline (below);
    # the lease keep-alive stream has no deadline (its owner keeps one per request).
    assert operations - {"close", "watch", "lease_keepalive"} == set(CALLS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_call_is_sent_with_the_clients_deadline(
    client: EtcdClient, record: Callable[..., Recorder], name: str
) -> None:
    recorder = record()
    CALLS[name](client)
    assert len(recorder.calls) == 1
    assert recorder.calls[0][2] == TIMEOUT_S


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.get("/k", timeout_s=0.5),
        lambda c: c.txn([], [Put("/k", b"v")], timeout_s=0.5),
        lambda c: c.grant_lease(5, timeout_s=0.5),
        lambda c: c.refresh_lease(7, timeout_s=0.5),
        lambda c: c.status(timeout_s=0.5),
    ],
)
def test_a_shorter_deadline_of_the_caller_is_the_calls(
    client: EtcdClient, record: Callable[..., Recorder], call: Callable[[EtcdClient], object]
) -> None:
    recorder = record()
    call(client)
    assert [deadline for _, _, deadline in recorder.calls] == [0.5]


def test_a_request_no_member_received_goes_once_to_the_next(
    client: EtcdClient, record: Callable[..., Recorder]
) -> None:
    recorder = record(RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    first = client.endpoint
    client.put("/k", b"v")
    (went_to, _, _), (resent_to, _, _) = recorder.calls
    assert went_to == first and resent_to != first
    assert client._client.picker.quarantined_for(first) > 0


def test_a_request_that_timed_out_is_not_resent(
    client: EtcdClient, record: Callable[..., Recorder]
) -> None:
    recorder = record(RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    with pytest.raises(EtcdUnavailableError, match=f"within {TIMEOUT_S:g} s"):
        client.put("/k", b"v")
    assert len(recorder.calls) == 1


class SilentWatch:
    """A watch call that etcd never answers: iterating it blocks until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Any]:
        assert self.cancelled.wait(timeout=30), "the watch was never cancelled"
        raise RpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")


def test_a_watch_etcd_never_confirms_ends_after_the_deadline_and_blames_its_member() -> None:
    blamed: list[grpc.RpcError | None] = []
    stream = WatchStream(
        what="watch /k",
        create=etcdrpc.WatchRequest(),
        open_call=lambda requests: SilentWatch(),
        translate=lambda what, exc: EtcdError(what),
        create_timeout_s=0.2,
        blame=blamed.append,
    )
    with pytest.raises(EtcdUnavailableError, match="etcd did not open the watch in time"):
        list(stream)
    assert blamed == [None]  # None: silence, not a refusal


def test_authentication_gets_the_longer_of_its_own_deadline_and_the_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd checks a password slowly on purpose (bcrypt); a loaded etcd took over 5 s."""
    deadlines: list[tuple[str, float]] = []

    def call(self: Any, stub: str, method: str, request: Any, timeout: float, **_: Any) -> Any:
        deadlines.append((method, timeout))
        return etcdrpc.AuthenticateResponse(token="t") if method == "Authenticate" else (
            ANSWERS[method]())

    monkeypatch.setattr(Transport, "call", call)
    monkeypatch.setattr(Transport, "set_token", lambda self, token, *, secure: None)
    for timeout_s, expected in ((TIMEOUT_S, AUTHENTICATE_TIMEOUT_S), (40.0, 40.0)):
        deadlines.clear()
        config = EtcdConfig(endpoints=[A], timeout_s=timeout_s, user="u", password="p")
        with EtcdClient(config) as client:
            client.get("/k")
        assert deadlines == [("Authenticate", expected), ("Range", timeout_s)]
