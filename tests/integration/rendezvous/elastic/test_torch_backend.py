"""The etcd-v3 RendezvousBackend and Store, against a real etcd.

The backend tests follow torch's RendezvousBackendTestMixin: the same contract
torch's c10d and etcd-v2 backends meet, named as sentences.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from rendezvous.elastic.etcd_v3 import (
    EtcdV3RendezvousBackend,
    EtcdV3Store,
    create_backend,
    delete_rendezvous,
)
from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer, free_port


@pytest.fixture
def backend(etcd_client: EtcdClient) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(etcd_client, "job-1")


@pytest.fixture
def store(etcd_client: EtcdClient) -> EtcdV3Store:
    return EtcdV3Store(
        etcd_client,
        etcd_client.keys.rdzv_store_prefix("job-1"),
        timeout=datetime.timedelta(seconds=5),
    )


@pytest.fixture
def restore_env() -> Iterator[None]:
    # create_etcd_v3_handler sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE in-process.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# --- backend contract ------------------------------------------------------------


def test_get_state_returns_none_if_backend_state_does_not_exist(backend):
    assert backend.get_state() is None


def test_set_state_sets_backend_state_if_it_does_not_exist(backend):
    state, token, written = backend.set_state(b"x")
    assert (state, written) == (b"x", True)
    assert backend.get_state() == (b"x", token)


def test_set_state_sets_backend_state_if_token_is_current(backend):
    _, token1, _ = backend.set_state(b"x")
    state, token2, written = backend.set_state(b"y", token1)
    assert (state, written) == (b"y", True)
    assert token2 != token1


def test_set_state_returns_current_state_if_state_is_already_set(backend):
    _, token1, _ = backend.set_state(b"x")
    state, token2, written = backend.set_state(b"y")
    assert (state, token2, written) == (b"x", token1, False)


def test_set_state_returns_current_state_if_token_is_old(backend):
    _, token1, _ = backend.set_state(b"x")
    _, token2, _ = backend.set_state(b"y", token1)
    state, token3, written = backend.set_state(b"z", token1)
    assert (state, token3, written) == (b"y", token2, False)


def test_set_state_returns_current_state_if_token_is_not_a_revision(backend):
    _, token1, _ = backend.set_state(b"x")
    assert backend.set_state(b"y", "not-a-revision") == (b"x", token1, False)


def test_set_state_round_trips_arbitrary_bytes_exactly(backend):
    payload = bytes(range(256)) * 4096 + b"\x00\xff"  # 1 MiB of every byte value
    state, token, written = backend.set_state(payload)
    assert written and state == payload
    assert backend.get_state() == (payload, token)


def test_concurrent_set_state_with_the_same_token_has_exactly_one_winner(
    etcd_config: EtcdConfig,
):
    clients = [create_client(etcd_config) for _ in range(8)]
    try:
        backends = [EtcdV3RendezvousBackend(c, "race") for c in clients]
        _, token, _ = backends[0].set_state(b"base")
        barrier = threading.Barrier(len(backends))
        results: list[tuple[bytes, str, bool]] = [None] * len(backends)  # type: ignore[list-item]

        def contend(i: int) -> None:
            barrier.wait()
            results[i] = backends[i].set_state(f"writer-{i}".encode(), token)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(backends))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        winners = [i for i, r in enumerate(results) if r[2]]
        assert len(winners) == 1
        final = backends[0].get_state()
        assert final is not None and final[0] == f"writer-{winners[0]}".encode()
        # Every loser got the winner's state and token back, not its own.
        assert all(r[:2] == final for r in results)
    finally:
        for c in clients:
            c.close()


def test_state_key_lives_under_a_lease_so_it_expires(backend, etcd_client):
    backend.set_state(b"x")
    kv = etcd_client.get(backend.key)
    assert kv is not None and kv.lease != 0
    assert 0 < etcd_client.lease_ttl(kv.lease) <= 7200


def test_keys_expire_after_key_ttl_once_nobody_writes(etcd_client):
    short = EtcdV3RendezvousBackend(etcd_client, "short-lived", key_ttl_s=2)
    short.set_state(b"x")
    deadline = time.monotonic() + 10
    while short.get_state() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert short.get_state() is None


def test_delete_rendezvous_removes_state_and_store(backend, store, etcd_client):
    backend.set_state(b"x")
    store.set("k", "v")
    assert delete_rendezvous(etcd_client, "job-1") == 2
    assert backend.get_state() is None and store.num_keys() == 0


def test_run_id_that_would_escape_its_prefix_is_refused(etcd_client):
    with pytest.raises(ValueError, match="run id"):
        EtcdV3RendezvousBackend(etcd_client, "../jobs/x")


# --- store -------------------------------------------------------------------------


def test_store_set_then_get_returns_the_bytes(store):
    store.set("a", b"\x00\x01")
    store.set("b", "text")
    assert store.get("a") == b"\x00\x01"
    assert store.get("b") == b"text"


def test_store_get_waits_until_another_thread_sets_the_key(store):
    timer = threading.Timer(0.3, store.set, args=("late", "v"))
    timer.start()
    try:
        assert store.get("late") == b"v"
    finally:
        timer.cancel()


def _count_reads(store):
    """The keys of each read the store makes from now on (its waits' reads included)."""
    reads = []
    real_read = store._read

    def counting_read(keys):
        reads.append(list(keys))
        return real_read(keys)

    store._read = counting_read
    return reads


def test_store_multi_get_waits_on_one_watch_and_takes_the_values_from_its_events(store):
    # Two keys put together by another thread while the reader waits: one read before
    # the wait, none after it (the events carry the values), the latest value of each.
    reads = _count_reads(store)

    def put_them():
        store.set("MASTER_ADDR", "stale")
        store.delete_key("MASTER_ADDR")
        store.multi_set(["MASTER_ADDR", "MASTER_PORT"], ["10.0.0.1", "29500"])

    timer = threading.Timer(0.3, put_them)
    timer.start()
    try:
        assert store.multi_get(["MASTER_ADDR", "MASTER_PORT"]) == [b"10.0.0.1", b"29500"]
    finally:
        timer.cancel()
    assert len(reads) == 1


def test_store_get_after_a_revision_watches_without_reading_first(store, etcd_client):
    # What every member but rank 0 does with the round's master key (#24): rank 0 puts it
    # after the round's state, so a watch from the state's revision finds it, before or
    # after it comes, without the read that finds nothing.
    reads = _count_reads(store)
    before = etcd_client.put(etcd_client.keys.rdzv_state("other"), b"the round's state")
    store.set("EARLY", "e")
    assert store.get_after("EARLY", before) == b"e"  # put before the call: replayed
    timer = threading.Timer(0.3, store.set, args=("LATE", "l"))
    timer.start()
    try:
        assert store.get_after("LATE", before) == b"l"
    finally:
        timer.cancel()
    assert reads == []
    assert store.get_after("EARLY", 0) == b"e"  # revision unknown: read
    etcd_client.compact(etcd_client.put(etcd_client.keys.rdzv_state("other"), b"later"))
    assert store.get_after("EARLY", before) == b"e"  # compacted: read
    assert len(reads) == 2


def test_store_wait_times_out_with_an_error_naming_the_missing_key(store):
    store.set("present", "1")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="absent"):
        store.wait(["present", "absent"], datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 5


def test_store_add_is_atomic_under_concurrency(etcd_config):
    clients = [create_client(etcd_config) for _ in range(4)]
    try:
        stores = [EtcdV3Store(c, c.keys.rdzv_store_prefix("adds")) for c in clients]

        def add_many(s: EtcdV3Store) -> None:
            for _ in range(25):
                s.add("counter", 1)

        threads = [threading.Thread(target=add_many, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert stores[0].get("counter") == b"100"
        assert stores[0].add("counter", -1) == 99
    finally:
        for c in clients:
            c.close()


def test_store_compare_set_follows_tcpstore_semantics(store):
    # absent key + empty expected: set
    assert store.compare_set("k", "", "first") == b"first"
    # wrong expected: unchanged, current value returned
    assert store.compare_set("k", "other", "second") == b"first"
    # right expected: swapped
    assert store.compare_set("k", "first", "second") == b"second"
    # absent key + non-empty expected: nothing set, expected returned
    assert store.compare_set("absent", "x", "y") == b"x"
    assert not store.check(["absent"])


def test_store_check_delete_num_keys_multi(store):
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.check(["x", "y"]) and not store.check(["x", "z"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]
    assert store.num_keys() == 2
    assert store.delete_key("x") and not store.delete_key("x")
    assert store.num_keys() == 1


# --- torch's handler on top of the backend --------------------------------------------


def _params(endpoint: str, run_id: str, root: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=3,
        max_nodes=3,
        local_addr="127.0.0.1",
        key_root=root,
        **conf,
    )


def test_torchrun_finds_the_backend_through_its_entry_point(etcd_server, etcd_root, restore_env):
    handler = get_rendezvous_handler(_params(etcd_server.endpoint, "ep", etcd_root))
    assert handler.get_backend() == "etcd-v3"
    assert handler.get_run_id() == "ep"
    # tidal's defaults fill in what --rdzv-conf left out
    assert handler.settings.keep_alive_interval == datetime.timedelta(seconds=1)
    assert handler.settings.timeout.last_call == datetime.timedelta(seconds=2)


def test_dynamic_handler_with_three_participants_joining_concurrently(
    etcd_server, etcd_root, restore_env
):
    handlers = [
        get_rendezvous_handler(_params(etcd_server.endpoint, "three", etcd_root))
        for _ in range(3)
    ]
    results: list[object] = [None] * 3

    def join(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
            results[i] = (info.rank, info.world_size, info.bootstrap_store_info)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(isinstance(r, Exception) for r in results), results
    ranks = sorted(r[0] for r in results)  # type: ignore[index]
    assert ranks == [0, 1, 2]
    assert {r[1] for r in results} == {3}  # type: ignore[index]
    # One master address for the round, published by rank 0, seen by all.
    masters = {(r[2].master_addr, r[2].master_port) for r in results}  # type: ignore[index]
    assert len(masters) == 1
    for h in handlers:
        h.shutdown()


def test_unreachable_etcd_fails_fast_with_a_connection_error(etcd_root):
    closed = f"127.0.0.1:{free_port()}"
    params = _params(closed, "nowhere", etcd_root, etcd_timeout="2")
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="did not answer"):
        create_backend(params)
    assert time.monotonic() - started < 2 + 3


def test_backend_rides_out_an_etcd_restart_within_its_grace(fresh_etcd: EtcdServer, etcd_root):
    client = create_client(EtcdConfig(endpoints=[fresh_etcd.endpoint], root=etcd_root))
    try:
        patient = EtcdV3RendezvousBackend(client, "restart", outage_grace_s=30)
        impatient = EtcdV3RendezvousBackend(client, "restart", outage_grace_s=0.5)
        _, token, _ = patient.set_state(b"before")
        fresh_etcd.kill()
        with pytest.raises(RendezvousConnectionError, match="did not answer"):
            impatient.get_state()
        restart = threading.Timer(1.0, fresh_etcd.start)
        restart.start()
        try:
            # Blocks while etcd is down, then answers from the same data dir.
            assert patient.get_state() == (b"before", token)
        finally:
            restart.join()
        assert patient.set_state(b"after", token)[2]
    finally:
        client.close()
