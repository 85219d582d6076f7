"""The keep-alives of a process's leases: one stream and two threads for every 32 (#24)."""

from __future__ import annotations

import threading
import urllib.request

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.lease import LEASES_PER_STREAM, KeepAlives, LeaseKeeper
from tests.support.wait import wait_for

LEASES = 100


def keepalive_streams_opened(server: EtcdServer) -> int:
    """LeaseKeepAlive streams etcd has seen opened (its /metrics)."""
    text = urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10).read().decode()
    return sum(int(float(line.rpartition(" ")[2])) for line in text.splitlines()
               if line.startswith("grpc_server_started_total{")
               and 'grpc_method="LeaseKeepAlive"' in line)


def keepalive_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("keep-alive")]


def test_every_lease_of_a_process_is_kept_alive_on_a_stream_per_32_by_two_threads_each(
    etcd_server: EtcdServer, etcd_client: EtcdClient
) -> None:
    # Not one stream for all: etcd answers a stream's keep-alives one at a time, each
    # behind its apply loop (a burst of 128 waited 6.6 s at the 1,024-member soak).
    opened = keepalive_streams_opened(etcd_server)
    lost = threading.Event()
    keepers = [LeaseKeeper(etcd_client, ttl_s=2, on_lost=lost.set, name=f"many {i}")
               for i in range(LEASES)]
    try:
        for keeper in keepers:
            keeper.start()
        # Three TTLs: a lease nobody kept alive would be gone twice over.
        assert not lost.wait(6.0)
        assert all(k.alive for k in keepers)
        assert {k.lease_id for k in keepers} <= KeepAlives.held()
        for keeper in keepers[:: LEASES // 10]:
            assert etcd_client.lease_ttl(keeper.lease_id) > 0
        streams = -(-LEASES // LEASES_PER_STREAM)
        assert keepalive_streams_opened(etcd_server) - opened == streams
        # Per stream, one thread sends, one reads the answers: not one per lease.
        assert sorted(t.name for t in keepalive_threads()) == sorted(
            ["keep-alive", "keep-alive answers"] * streams)
    finally:
        for keeper in keepers:
            keeper.close()
    wait_for(lambda: not keepalive_threads(), timeout=5,
             what="the keep-alive threads to end with the last lease")


def test_an_owner_that_blocks_on_a_loss_delays_no_other_lease(etcd_client: EtcdClient) -> None:
    release = threading.Event()
    told = threading.Event()

    def block() -> None:
        told.set()
        release.wait(30)

    doomed = LeaseKeeper(etcd_client, ttl_s=2, on_lost=block, name="doomed").start()
    other_lost = threading.Event()
    other = LeaseKeeper(etcd_client, ttl_s=2, on_lost=other_lost.set, name="other").start()
    try:
        etcd_client.revoke_lease(doomed.lease_id)
        wait_for(told.is_set, timeout=4, what="the doomed lease's owner to be told")
        # The owner still blocks; the other lease is kept alive for three more TTLs.
        assert not other_lost.wait(6.0)
        assert other.alive and etcd_client.lease_ttl(other.lease_id) > 0
    finally:
        release.set()
        other.close()
        doomed.close()


def test_a_lease_closed_and_one_started_after_reuse_the_process_keep_alives(
    etcd_client: EtcdClient,
) -> None:
    first = LeaseKeeper(etcd_client, ttl_s=2).start()
    first.close()
    wait_for(lambda: not keepalive_threads(), timeout=5, what="the keep-alives to end")
    lost = threading.Event()
    with LeaseKeeper(etcd_client, ttl_s=2, on_lost=lost.set) as second:
        assert not lost.wait(4.0)
        assert second.alive and etcd_client.lease_ttl(second.lease_id) > 0
