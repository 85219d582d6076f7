"""Failover away from a silent etcd member, against a real 3-member etcd cluster.

A member that swallows calls (cut off from the network; here SIGSTOPped, see
tests/integration/rendezvous/etcd_cluster.py) must cost a liveness-critical
call one short deadline of its own, not the client's whole timeout; the retry
goes to a live member, and the silent one is left alone for a while. The
member paused is always a follower: a silent leader stalls every write of the
cluster until a new one is elected, which is an etcd outage, not a failover.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rendezvous.elastic.etcd_v3 import EtcdV3RendezvousBackend, create_backend
from rendezvous.errors import EtcdUnavailableError
from rendezvous.etcd import EtcdClient, EtcdConfig, Get, create_client
from rendezvous.etcd.server import EtcdServer, find_etcd_binary
from rendezvous.lease import LeaseKeeper
from tests.integration.rendezvous.etcd_cluster import LoopbackEtcdCluster, wait_stopped
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

# The client's own timeout: what a call to a silent member cost before.
CLIENT_TIMEOUT_S = 5.0
# A bound on a wait, not a performance target: scheduling slack on a busy 2-core machine.
MARGIN_S = 1.0
ROOT = "/tidal-failover"


@pytest.fixture
def etcd_cluster(procs: ProcessGroupRegistry, tmp_path: Path) -> Iterator[LoopbackEtcdCluster]:
    cluster = LoopbackEtcdCluster(procs, tmp_path, find_etcd_binary()).start()
    try:
        yield cluster
    finally:
        for name in cluster.members:
            cluster.resume(name)  # a stopped process ignores SIGTERM until continued


@pytest.fixture
def client(etcd_cluster: LoopbackEtcdCluster) -> Iterator[EtcdClient]:
    """A client on every member, whose calls go to a follower."""
    config = EtcdConfig(endpoints=etcd_cluster.endpoints, timeout_s=CLIENT_TIMEOUT_S, root=ROOT)
    with create_client(config) as built:
        etcd_cluster.move_leader(away_from=etcd_cluster.name_of(built.endpoint))
        yield built


def _observer(cluster: LoopbackEtcdCluster, avoid: str) -> EtcdClient:
    """A client on one member other than ``avoid``: what the rest of the cluster sees."""
    other = next(m.endpoint for m in cluster.members.values() if m.endpoint != avoid)
    return create_client(EtcdConfig(endpoints=[other], timeout_s=CLIENT_TIMEOUT_S, root=ROOT))


def test_a_capped_call_to_a_silent_member_fails_within_its_own_deadline_and_the_next_goes_on(
    etcd_cluster: LoopbackEtcdCluster, client: EtcdClient
) -> None:
    key = client.keys.job("failover")
    client.put(key, b"before")
    silent = client.endpoint
    etcd_cluster.pause(etcd_cluster.name_of(silent))

    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=f"{silent} did not answer get .* within 0.5 s"):
        client.get(key, timeout_s=0.5)
    assert time.monotonic() - started < 0.5 + MARGIN_S
    assert client.endpoint != silent

    started = time.monotonic()
    kv = client.get(key)  # the client's full timeout: it must not be needed
    assert kv is not None and kv.value == b"before"
    assert time.monotonic() - started < MARGIN_S


def test_a_silent_member_is_left_alone_after_a_missed_deadline(
    etcd_cluster: LoopbackEtcdCluster, client: EtcdClient
) -> None:
    key = client.keys.job("quarantine")
    client.put(key, b"x")
    silent = client.endpoint
    etcd_cluster.pause(etcd_cluster.name_of(silent))
    with pytest.raises(EtcdUnavailableError):
        client.txn([], [Get(key)], timeout_s=0.5)

    # Longer than a refused member is skipped (2 s): a silent one stays skipped.
    slowest = 0.0
    until = time.monotonic() + 3.0
    while time.monotonic() < until:
        started = time.monotonic()
        assert client.get(key, timeout_s=CLIENT_TIMEOUT_S) is not None
        slowest = max(slowest, time.monotonic() - started)
        assert client.endpoint != silent
        time.sleep(0.1)
    assert slowest < MARGIN_S


def test_a_rendezvous_state_write_through_a_silent_member_lands_well_within_the_window(
    etcd_cluster: LoopbackEtcdCluster, client: EtcdClient
) -> None:
    backend = EtcdV3RendezvousBackend(client, "job-f", call_timeout_s=1.0)
    first = backend.set_state(b"round-1")
    assert first is not None and first[2]
    silent = client.endpoint
    etcd_cluster.pause(etcd_cluster.name_of(silent))

    started = time.monotonic()
    result = backend.set_state(b"round-2", first[1])
    elapsed = time.monotonic() - started
    # One missed 1 s deadline, a short backoff, an answer from a live member:
    # far inside the 5 s after which the peers would drop this node.
    assert elapsed < 1.0 + 0.1 + MARGIN_S, elapsed
    assert result is not None
    state, token, written = result
    assert (state, written) == (b"round-2", True)

    with _observer(etcd_cluster, avoid=silent) as observer:
        assert observer.get(backend.key) is not None
        # The timed-out attempt sat in the silent member's socket. Resumed, it
        # may process it now; guarded on the old revision, it cannot apply.
        etcd_cluster.resume(etcd_cluster.name_of(silent))
        wait_for(lambda: etcd_cluster.healthy(etcd_cluster.name_of(silent)), timeout=10,
                 what="the resumed member healthy")
        time.sleep(1.0)
        kv = observer.get(backend.key)
        assert kv is not None and (kv.value, str(kv.mod_revision)) == (b"round-2", token)


def test_a_lease_kept_through_a_silent_member_is_not_lost(
    etcd_cluster: LoopbackEtcdCluster, client: EtcdClient
) -> None:
    lost = threading.Event()
    key = client.keys.node("kept-through-failover")
    with LeaseKeeper(client, ttl_s=2, on_lost=lost.set, name="failover") as keeper:
        client.put(key, b"x", lease=keeper.lease_id)
        silent = client.endpoint
        etcd_cluster.pause(etcd_cluster.name_of(silent))
        # Three TTLs: the first keep-alive after the pause misses its deadline
        # (one interval, 2/3 s) and is sent again to a live member in time.
        assert not lost.wait(6.0)
        assert keeper.alive
        with _observer(etcd_cluster, avoid=silent) as observer:
            assert observer.get(key) is not None
            assert observer.lease_ttl(keeper.lease_id) > 0


def test_the_rendezvous_call_deadline_follows_the_liveness_window(
    etcd_server: EtcdServer,
) -> None:
    def backend_for(client: EtcdClient, **conf: str) -> EtcdV3RendezvousBackend:
        params = RendezvousParameters(backend="etcd-v3", endpoint="unused:1", run_id="job-d",
                                      min_nodes=1, max_nodes=1, **conf)
        return create_backend(params, client=client)[0]

    # Nothing is called: the second endpoint need not exist.
    several = EtcdConfig(endpoints=[etcd_server.endpoint, "127.0.0.1:1"], timeout_s=10.0)
    with create_client(several, probe=False) as client:
        assert backend_for(client, keep_alive_interval="1",
                           keep_alive_max_attempt="5").call_timeout_s == 1.0
        assert backend_for(client).call_timeout_s == 3.0  # torch's defaults: 5 s x 3
        assert backend_for(client, etcd_call_timeout="0.7").call_timeout_s == 0.7
        with pytest.raises(ValueError, match="etcd_call_timeout"):
            backend_for(client, etcd_call_timeout="0")
    with create_client(EtcdConfig(endpoints=[etcd_server.endpoint])) as client:
        # One endpoint: no other member to fail over to; the client's timeout.
        assert backend_for(client, keep_alive_interval="1").call_timeout_s is None
        assert backend_for(client, etcd_call_timeout="0.7").call_timeout_s == 0.7


# one member ------------------------------------------------------------------------


def test_capped_calls_to_a_paused_single_etcd_fail_within_their_own_deadline(
    fresh_etcd: EtcdServer,
) -> None:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=CLIENT_TIMEOUT_S,
                        root="/tidal-capped")
    with create_client(config) as client:
        key = client.keys.job("j")
        client.put(key, b"x")
        lease = client.grant_lease(10)
        fresh_etcd.pause()
        assert fresh_etcd.pid is not None
        wait_stopped(fresh_etcd.pid)
        try:
            for what, call in [
                ("get", lambda: client.get(key, timeout_s=0.3)),
                ("txn", lambda: client.txn([], [Get(key)], timeout_s=0.3)),
                ("refresh", lambda: client.refresh_lease(lease, timeout_s=0.3)),
                ("grant", lambda: client.grant_lease(5, timeout_s=0.3)),
                ("status", lambda: client.status(timeout_s=0.3)),
            ]:
                started = time.monotonic()
                with pytest.raises(EtcdUnavailableError, match=r"within 0\.3 s"):
                    call()
                assert time.monotonic() - started < 0.3 + MARGIN_S, what
        finally:
            fresh_etcd.resume()
        # A single endpoint is never quarantined: the next call goes through.
        kv = wait_for(lambda: client.get(key), timeout=10, what="etcd to answer again")
        assert kv is not None and kv.value == b"x"
