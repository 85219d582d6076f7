"""The etcd client facade against a real etcd: key-value, transactions, leases, errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvous.errors import EtcdCompactedError, EtcdUnavailableError, LeaseExpiredError
from rendezvous.etcd import (
    Compare,
    Delete,
    EtcdClient,
    EtcdConfig,
    Get,
    Put,
    create_client,
    create_client_waiting,
)
from rendezvous.etcd.server import EtcdServer, free_port
from tests.integration.rendezvous.etcd_cluster import wait_stopped
from tests.support.wait import wait_for

# A bound on a hang, not a performance target: an error must come within the
# configured timeout plus scheduling slack on a busy 2-core machine.
MARGIN_S = 2.0


def test_put_get_and_delete_round_trip(etcd_client: EtcdClient) -> None:
    key = etcd_client.keys.job("j1")
    assert etcd_client.get(key) is None
    revision = etcd_client.put(key, b"spec")
    kv = etcd_client.get(key)
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.version, kv.lease) == (
        key,
        b"spec",
        revision,
        revision,
        1,
        0,
    )
    assert etcd_client.delete(key) is True
    assert etcd_client.delete(key) is False
    assert etcd_client.get(key) is None


def test_get_prefix_is_sorted_and_does_not_match_a_longer_sibling(etcd_client: EtcdClient) -> None:
    keys = etcd_client.keys
    for job in ("job-1", "job-10", "job-2"):
        for node in ("b", "a"):
            etcd_client.put(keys.status(job, node), job.encode())
    kvs, revision = etcd_client.get_prefix(keys.job_status_prefix("job-1"))
    assert [kv.key for kv in kvs] == [keys.status("job-1", "a"), keys.status("job-1", "b")]
    assert revision >= max(kv.mod_revision for kv in kvs)
    assert etcd_client.count_prefix(keys.status_prefix()) == 6
    assert etcd_client.delete_prefix(keys.job_status_prefix("job-1")) == 2
    assert etcd_client.count_prefix(keys.status_prefix()) == 4


def test_txn_compare_and_swap_succeeds_only_on_the_current_revision(
    etcd_client: EtcdClient,
) -> None:
    key = etcd_client.keys.job("cas")
    created = etcd_client.txn([Compare(key, "create", "==", 0)], [Put(key, b"v1")], [Get(key)])
    assert created.succeeded
    again = etcd_client.txn([Compare(key, "create", "==", 0)], [Put(key, b"x")], [Get(key)])
    assert not again.succeeded
    assert [kv.value for kv in again.gets[0]] == [b"v1"]
    token = again.gets[0][0].mod_revision

    swapped = etcd_client.txn([Compare(key, "mod", "==", token)], [Put(key, b"v2"), Get(key)])
    assert swapped.succeeded and swapped.gets[0][0].value == b"v2"
    stale = etcd_client.txn([Compare(key, "mod", "==", token)], [Put(key, b"lost")], [Get(key)])
    assert not stale.succeeded and stale.gets[0][0].value == b"v2"

    by_value = etcd_client.txn([Compare(key, "value", "==", b"v2")], [Delete(key)])
    assert by_value.succeeded and etcd_client.get(key) is None


def test_txn_compares_on_a_key_lease(etcd_client: EtcdClient) -> None:
    key = etcd_client.keys.node("n1")
    lease = etcd_client.grant_lease(5)
    try:
        etcd_client.put(key, b"x", lease=lease)
        assert etcd_client.txn([Compare(key, "lease", "==", lease)], [Put(key, b"y", lease=lease)])
        assert not etcd_client.txn(
            [Compare(key, "lease", "==", lease + 1)], [Delete(key)]
        ).succeeded
        assert etcd_client.get(key).value == b"y"  # type: ignore[union-attr]
    finally:
        etcd_client.revoke_lease(lease)
    assert etcd_client.get(key) is None


def test_a_key_on_an_unrefreshed_lease_expires(etcd_client: EtcdClient) -> None:
    key = etcd_client.keys.node("ephemeral")
    lease = etcd_client.grant_lease(2)
    etcd_client.put(key, b"x", lease=lease)
    assert 0 < etcd_client.lease_ttl(lease) <= 2
    assert etcd_client.refresh_lease(lease) == 2
    wait_for(lambda: etcd_client.get(key) is None, timeout=5, what="the leased key to expire")
    assert etcd_client.lease_ttl(lease) == -1
    with pytest.raises(LeaseExpiredError, match="expired"):
        etcd_client.refresh_lease(lease)
    etcd_client.revoke_lease(lease)  # already gone: not an error


def test_grant_lease_rejects_a_ttl_below_one_second(etcd_client: EtcdClient) -> None:
    with pytest.raises(ValueError, match=r"lease ttl \(0\) must be at least 1 second"):
        etcd_client.grant_lease(0)


def test_watch_stream_delivers_events_in_order_and_ends_on_cancel(
    etcd_client: EtcdClient,
) -> None:
    prefix = etcd_client.keys.jobs_prefix()
    _, revision = etcd_client.get_prefix(prefix)
    stream = etcd_client.watch(prefix, prefix=True, start_revision=revision + 1)
    etcd_client.put(prefix + "a", b"1")
    etcd_client.put(prefix + "b", b"2")
    etcd_client.delete(prefix + "a")
    seen: list[tuple[str, str, bytes]] = []
    for batch in stream:
        seen.extend((ev.kind, ev.key[len(prefix) :], ev.value) for ev in batch.events)
        if len(seen) >= 3:
            stream.cancel()
    assert seen == [("put", "a", b"1"), ("put", "b", b"2"), ("delete", "a", b"")]
    assert stream.cancelled


def test_watch_from_a_compacted_revision_raises_compacted(etcd_client: EtcdClient) -> None:
    key = etcd_client.keys.job("compact-me")
    first = etcd_client.put(key, b"1")
    last = etcd_client.put(key, b"2")
    etcd_client.compact(last)
    stream = etcd_client.watch(key, prefix=False, start_revision=first)
    with pytest.raises(EtcdCompactedError) as info:
        next(iter(stream))
    assert info.value.compact_revision >= last


def test_an_unreachable_endpoint_fails_within_the_timeout() -> None:
    config = EtcdConfig(endpoints=[f"127.0.0.1:{free_port()}"], timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="did not answer"):
        create_client(config)
    assert time.monotonic() - started < config.timeout_s + MARGIN_S

    client = create_client(config, probe=False)  # fails on use instead
    try:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailableError):
            client.get("/tidal/x")
        assert time.monotonic() - started < config.timeout_s + MARGIN_S
    finally:
        client.close()


class _Tries(logging.Handler):
    """Counts create_client_waiting's "trying again" warnings; ``first`` is set at the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "trying again" in record.getMessage():
            self.count += 1
            self.first.set()


@pytest.fixture
def tries() -> Iterator[_Tries]:
    handler = _Tries()
    logger = logging.getLogger("rendezvous.etcd")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_a_daemon_started_before_etcd_waits_for_it(tmp_path: Path, tries: _Tries) -> None:
    """An agent or coordinator may start before etcd, or while it is too loaded to answer
    (a test run saw an agent's first call time out and the agent exit): it tries again."""
    port = free_port()
    config = EtcdConfig(endpoints=[f"127.0.0.1:{port}"], timeout_s=1.0)
    got: list[EtcdClient | BaseException] = []

    def connect() -> None:
        try:
            got.append(create_client_waiting(config, wait_s=120, retry_s=0.2))
        except BaseException as exc:  # reported by the test below
            got.append(exc)

    thread = threading.Thread(target=connect, name="connect")
    thread.start()
    server = EtcdServer(data_dir=tmp_path / "etcd", client_port=port)
    try:
        assert tries.first.wait(30), "no failed try was logged"
        server.start()
        thread.join(timeout=60)
        assert not thread.is_alive() and len(got) == 1, got
        client = got[0]
        assert isinstance(client, EtcdClient), client
        with client:
            client.put(client.keys.job("late"), b"x")
            kv = client.get(client.keys.job("late"))
            assert kv is not None and kv.value == b"x"
        assert tries.count >= 1
    finally:
        server.cleanup()
        thread.join(timeout=60)


def test_waiting_for_etcd_ends_with_the_last_error(tries: _Tries) -> None:
    config = EtcdConfig(endpoints=[f"127.0.0.1:{free_port()}"], timeout_s=0.5)
    with pytest.raises(EtcdUnavailableError, match="did not answer"):
        create_client_waiting(config, wait_s=1.0, retry_s=0.1)
    assert tries.count >= 1  # tried more than once before giving up
    stop = threading.Event()
    stop.set()
    seen = tries.count
    with pytest.raises(EtcdUnavailableError):  # stopped: the first failure is the last
        create_client_waiting(config, wait_s=600, stop=stop)
    assert tries.count == seen


def test_a_paused_etcd_fails_calls_within_the_timeout_instead_of_hanging(
    fresh_etcd: EtcdServer,
) -> None:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=1.0, root="/tidal-paused")
    with create_client(config) as client:
        client.put(client.keys.job("j"), b"x")
        lease = client.grant_lease(10)
        fresh_etcd.pause()
        assert fresh_etcd.pid is not None
        wait_stopped(fresh_etcd.pid)  # else a call sent at once may still be answered
        try:
            calls: list[tuple[str, Callable[[], object]]] = [
                ("get", lambda: client.get(client.keys.job("j"))),
                ("put", lambda: client.put(client.keys.job("j"), b"y")),
                ("txn", lambda: client.txn([], [Get(client.keys.job("j"))])),
                ("refresh", lambda: client.refresh_lease(lease)),
            ]
            for what, call in calls:
                started = time.monotonic()
                with pytest.raises(EtcdUnavailableError):
                    call()
                elapsed = time.monotonic() - started
                assert elapsed < config.timeout_s + MARGIN_S, (what, elapsed)
        finally:
            fresh_etcd.resume()
        # The same client works again once etcd answers: no endpoint blacklisting.
        kv = wait_for(
            lambda: client.get(client.keys.job("j")), timeout=10, what="etcd to answer again"
        )
        # A write that timed out is indeterminate, not failed: the paused etcd
        # still had the put in its socket buffer and may apply it on resume.
        assert kv is not None and kv.value in (b"x", b"y")


def test_the_client_recovers_after_an_etcd_restart(fresh_etcd: EtcdServer) -> None:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=1.0, root="/tidal-restart")
    with create_client(config) as client:
        key = client.keys.job("j")
        client.put(key, b"before")
        fresh_etcd.kill()
        with pytest.raises(EtcdUnavailableError):
            client.get(key)
        fresh_etcd.start()
        kv = wait_for(lambda: client.get(key), timeout=10, what="the client to reconnect")
        assert kv is not None and kv.value == b"before"  # same data dir: nothing lost
