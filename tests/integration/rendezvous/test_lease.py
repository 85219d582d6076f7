"""LeaseKeeper against a real etcd: kept alive, revoked, lost, and riding out outages."""

from __future__ import annotations

import threading
import time

import pytest

from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.lease import KeepAlives, LeaseKeeper
from tests.support.wait import wait_for

MARGIN_S = 1.5  # scheduling slack on a shared 2-core machine, for bounds on waits


class LostCounter:
    """An on_lost callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.event.set()


def test_the_keeper_keeps_a_lease_alive_past_several_ttls(etcd_client: EtcdClient) -> None:
    lost = LostCounter()
    key = etcd_client.keys.node("kept")
    with LeaseKeeper(etcd_client, ttl_s=2, on_lost=lost, name="kept") as keeper:
        etcd_client.put(key, b"x", lease=keeper.lease_id)
        assert not keeper.wait_lost(timeout=5.0)  # 2.5 TTLs without a loss
        assert keeper.alive
        assert etcd_client.get(key) is not None
        assert etcd_client.lease_ttl(keeper.lease_id) > 0
    assert lost.calls == 0


def test_close_revokes_the_lease_and_deletes_its_keys_at_once(etcd_client: EtcdClient) -> None:
    lost = LostCounter()
    keeper = LeaseKeeper(etcd_client, ttl_s=30, on_lost=lost).start()
    key = etcd_client.keys.node("revoked")
    etcd_client.put(key, b"x", lease=keeper.lease_id)
    keeper.close()
    assert etcd_client.get(key) is None
    assert etcd_client.lease_ttl(keeper.lease_id) == -1
    assert not keeper.alive and lost.calls == 0
    keeper.close()  # twice is fine


def test_close_without_revoke_lets_the_lease_expire_within_its_ttl(
    etcd_client: EtcdClient,
) -> None:
    lost = LostCounter()
    keeper = LeaseKeeper(etcd_client, ttl_s=2, on_lost=lost).start()
    key = etcd_client.keys.node("abandoned")
    etcd_client.put(key, b"x", lease=keeper.lease_id)
    keeper.close(revoke=False)
    stopped = time.monotonic()
    assert etcd_client.get(key) is not None  # not revoked
    wait_for(lambda: etcd_client.get(key) is None, timeout=2 + MARGIN_S, what="the key to expire")
    assert time.monotonic() - stopped <= 2 + MARGIN_S
    assert lost.calls == 0  # closed keepers do not report losses


def test_a_lease_revoked_by_someone_else_is_reported_lost_once(etcd_client: EtcdClient) -> None:
    lost = LostCounter()
    keeper = LeaseKeeper(etcd_client, ttl_s=3, on_lost=lost).start()
    try:
        etcd_client.revoke_lease(keeper.lease_id)
        # The next keep-alive (every ttl/3 = 1 s) finds the lease gone.
        assert lost.event.wait(timeout=1 + MARGIN_S)
        assert keeper.lost and not keeper.alive
        assert keeper.lease_id not in KeepAlives.held()  # the keeper stops after a loss
        assert lost.calls == 1
    finally:
        keeper.close()
    assert lost.calls == 1


def test_an_on_lost_callback_that_raises_is_logged(
    etcd_client: EtcdClient, caplog: pytest.LogCaptureFixture
) -> None:
    def explode() -> None:
        raise RuntimeError("boom")

    keeper = LeaseKeeper(etcd_client, ttl_s=2, on_lost=explode, name="exploding").start()
    etcd_client.revoke_lease(keeper.lease_id)
    assert keeper.wait_lost(timeout=2 + MARGIN_S)
    wait_for(
        lambda: "the on_lost callback" in caplog.text, timeout=2, what="the callback error log"
    )
    keeper.close()


def test_the_keeper_rides_out_an_etcd_pause_shorter_than_the_ttl(fresh_etcd: EtcdServer) -> None:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=2.0, root="/tidal-lease")
    with create_client(config) as client:
        lost = LostCounter()
        ttl = 6
        with LeaseKeeper(client, ttl_s=ttl, on_lost=lost) as keeper:
            key = client.keys.node("paused")
            client.put(key, b"x", lease=keeper.lease_id)
            fresh_etcd.pause()
            try:
                # Keep-alives fail: the keeper's deadline runs down, but not out.
                wait_for(
                    lambda: keeper.remaining_s() < ttl / 2,
                    timeout=ttl,
                    what="keep-alives to fail while etcd is paused",
                )
            finally:
                fresh_etcd.resume()
            wait_for(
                lambda: keeper.remaining_s() > ttl * 0.8,
                timeout=ttl,
                what="a keep-alive to succeed after etcd resumed",
            )
            assert keeper.alive and lost.calls == 0
            assert client.get(key) is not None


def test_the_keeper_rides_out_an_etcd_restart_shorter_than_the_ttl(
    fresh_etcd: EtcdServer,
) -> None:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=2.0, root="/tidal-lease")
    with create_client(config) as client:
        lost = LostCounter()
        ttl = 6
        with LeaseKeeper(client, ttl_s=ttl, on_lost=lost) as keeper:
            key = client.keys.node("restarted")
            client.put(key, b"x", lease=keeper.lease_id)
            fresh_etcd.kill()
            fresh_etcd.start()
            wait_for(
                lambda: client.lease_ttl(keeper.lease_id) > 0 and keeper.remaining_s() > ttl * 0.8,
                timeout=ttl,
                what="a keep-alive to succeed on the restarted etcd",
            )
            assert keeper.alive and lost.calls == 0
            assert client.get(key) is not None


def test_an_outage_longer_than_the_ttl_loses_the_lease_by_the_keepers_clock(
    fresh_etcd: EtcdServer,
) -> None:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=5.0, root="/tidal-lease")
    with create_client(config) as client:
        lost = LostCounter()
        ttl = 2
        keeper = LeaseKeeper(client, ttl_s=ttl, on_lost=lost).start()
        try:
            fresh_etcd.pause()
            paused = time.monotonic()
            # Keep-alives are cut short at the lease's deadline, not the client's
            # 5 s timeout: the loss is known within the TTL.
            assert lost.event.wait(timeout=ttl + MARGIN_S)
            assert time.monotonic() - paused <= ttl + MARGIN_S
        finally:
            fresh_etcd.resume()
        keeper.close()
        assert lost.calls == 1 and keeper.lost


def test_invalid_settings_are_refused_with_the_value(etcd_client: EtcdClient) -> None:
    with pytest.raises(ValueError, match=r"ttl_s \(1\) must be at least 2"):
        LeaseKeeper(etcd_client, ttl_s=1)
    with pytest.raises(ValueError, match=r"interval_s \(3\) must be in"):
        LeaseKeeper(etcd_client, ttl_s=3, interval_s=3)
    keeper = LeaseKeeper(etcd_client, ttl_s=2)
    with pytest.raises(RuntimeError, match="has not been started"):
        _ = keeper.lease_id
    keeper.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            keeper.start()
    finally:
        keeper.close()
