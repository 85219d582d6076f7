"""Leader election against a real etcd: one leader, hand-over, and fencing a deposed leader."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from rendezvous.election import Election, ElectionTimeoutError, NotLeaderError
from rendezvous.etcd import Compare, EtcdClient, EtcdConfig, Get, Put
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

MARGIN_S = 1.5  # scheduling slack on a shared 2-core machine, for bounds on waits

# A leader in a child process that writes through the fence every 50 ms and
# logs what etcd made of each write.
CHILD = """
import sys, time
from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.election import Election, NotLeaderError
endpoint, root, target = sys.argv[1], sys.argv[2], sys.argv[3]
client = create_client(EtcdConfig(endpoints=[endpoint], timeout_s=2.0, root=root))
election = Election(client, "coord", value=b"child", ttl_s=2)
election.campaign(timeout=20)
print("leader", flush=True)
n = 0
while True:
    n += 1
    try:
        revision = election.fenced_put(target, b"child %d" % n)
        print("accepted", n, revision, flush=True)
    except NotLeaderError:
        print("rejected", n, flush=True)
    except Exception as exc:
        print("error", n, type(exc).__name__, flush=True)
    time.sleep(0.05)
"""


def campaign_in_thread(election: Election, timeout: float) -> threading.Thread:
    def run() -> None:
        # Resigned or timed out: the test checks is_leader instead.
        with contextlib.suppress(Exception):
            election.campaign(timeout=timeout)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def candidates(client: EtcdClient) -> int:
    return client.count_prefix(client.keys.election_prefix("coord"))


def test_one_leader_among_three_and_the_next_takes_over(etcd_client: EtcdClient) -> None:
    ttl = 3
    elections = [
        Election(etcd_client, "coord", value=f"e{i}".encode(), ttl_s=ttl) for i in range(3)
    ]
    first, second, third = elections
    try:
        first.campaign(timeout=5)
        assert first.is_leader
        campaign_in_thread(second, timeout=30)
        wait_for(lambda: candidates(etcd_client) == 2, timeout=5, what="the second candidate")
        campaign_in_thread(third, timeout=30)
        wait_for(lambda: candidates(etcd_client) == 3, timeout=5, what="the third candidate")
        assert [e.is_leader for e in elections] == [True, False, False]
        assert first.leader().value == b"e0"  # type: ignore[union-attr]

        # Resigning hands over at once, to the next candidate in line.
        resigned = time.monotonic()
        first.resign()
        wait_for(lambda: second.is_leader, timeout=5, what="the second candidate to lead")
        handover_s = time.monotonic() - resigned
        assert [e.is_leader for e in elections] == [False, True, False]
        assert second.leader().value == b"e1"  # type: ignore[union-attr]

        # A leader that stops refreshing its lease (a crash) is replaced within the TTL.
        second._keeper.close(revoke=False)  # type: ignore[union-attr]
        stopped = time.monotonic()
        wait_for(lambda: third.is_leader, timeout=ttl + 5, what="the third candidate to lead")
        takeover_s = time.monotonic() - stopped
        assert takeover_s <= ttl + MARGIN_S, f"took over after {takeover_s:.2f} s"
        assert third.leader().value == b"e2"  # type: ignore[union-attr]
        assert handover_s <= MARGIN_S, f"hand-over after a resign took {handover_s:.2f} s"
    finally:
        for election in elections:
            election.resign()
    assert candidates(etcd_client) == 0


def test_a_campaign_that_times_out_withdraws_its_candidacy(etcd_client: EtcdClient) -> None:
    with Election(etcd_client, "coord", ttl_s=3) as leader:
        leader.campaign(timeout=5)
        loser = Election(etcd_client, "coord", ttl_s=3)
        with pytest.raises(ElectionTimeoutError, match="did not become leader in time"):
            loser.campaign(timeout=0.5)
        assert not loser.is_leader
        assert candidates(etcd_client) == 1
        assert leader.is_leader


def test_fenced_writes_go_through_only_for_the_leader(etcd_client: EtcdClient) -> None:
    target = etcd_client.keys.job("fenced")
    with Election(etcd_client, "coord", ttl_s=3) as leader:
        follower = Election(etcd_client, "coord", ttl_s=3)
        with pytest.raises(NotLeaderError, match="is not leader"):
            follower.fenced_put(target, b"x")
        leader.campaign(timeout=5)
        revision = leader.fenced_put(target, b"v1")
        assert etcd_client.get(target).mod_revision == revision  # type: ignore[union-attr]
        # A caller's own guard failing is not a lost leadership.
        result = leader.fenced_txn(
            [Compare(target, "value", "==", b"other")], [Put(target, b"no")], [Get(target)]
        )
        assert not result.succeeded
        assert [[kv.value for kv in got] for got in result.gets] == [[b"v1"]]
        assert leader.is_leader


def test_a_deposed_leader_is_told_and_its_writes_are_rejected_by_etcd(
    etcd_client: EtcdClient,
) -> None:
    ttl = 2
    target = etcd_client.keys.job("fenced")
    lost = threading.Event()
    old = Election(etcd_client, "coord", ttl_s=ttl, on_lost=lost.set)
    new = Election(etcd_client, "coord", ttl_s=ttl)
    try:
        old.campaign(timeout=5)
        old.fenced_put(target, b"old")
        # Simulate a pause: keep-alives stop and the process believes it still leads.
        old._keeper.close(revoke=False)  # type: ignore[union-attr]
        new.campaign(timeout=ttl + 5)
        new.fenced_put(target, b"new")
        with pytest.raises(NotLeaderError, match="was deposed"):
            old.fenced_put(target, b"stale")  # etcd evaluates the guard and refuses
        assert etcd_client.get(target).value == b"new"  # type: ignore[union-attr]
        assert not old.is_leader and new.is_leader
    finally:
        old.resign()
        new.resign()


def test_a_leader_whose_lease_is_revoked_calls_on_lost(etcd_client: EtcdClient) -> None:
    lost = threading.Event()
    election = Election(etcd_client, "coord", ttl_s=3, on_lost=lost.set)
    try:
        election.campaign(timeout=5)
        etcd_client.revoke_lease(election.lease_id)
        assert lost.wait(timeout=1 + MARGIN_S)
        assert not election.is_leader
        with pytest.raises(NotLeaderError):
            election.fenced_put(etcd_client.keys.job("x"), b"x")
    finally:
        election.resign()


def test_a_paused_leader_process_gets_no_stale_write_accepted(
    etcd_client: EtcdClient,
    etcd_config: EtcdConfig,
    procs: ProcessGroupRegistry,
    tmp_path: Path,
) -> None:
    target = etcd_client.keys.job("fenced")
    log_path = tmp_path / "leader.log"
    argv = [sys.executable, "-c", CHILD, etcd_config.endpoints[0], etcd_config.root, target]
    child = procs.spawn(argv, log_path=log_path)

    def child_says(word: str) -> bool:
        if child.poll() is not None:
            raise AssertionError(f"the child leader exited: {log_path.read_text()}")
        return word in log_path.read_text()

    wait_for(lambda: child_says("accepted"), timeout=20, what="the child to lead and write")
    successor = Election(etcd_client, "coord", ttl_s=3)
    try:
        procs.signal_group(child, signal.SIGSTOP)  # paused longer than its 2 s TTL
        successor.campaign(timeout=15)
        fence = successor.fenced_put(target, b"successor")
        procs.signal_group(child, signal.SIGCONT)
        wait_for(lambda: child_says("rejected"), timeout=10, what="the child's writes to bounce")
        procs.kill_group(child)

        lines = [line.split() for line in log_path.read_text().splitlines()]
        stale = [ln for ln in lines if ln[0] == "accepted" and int(ln[2]) > fence]
        assert stale == [], f"stale writes accepted: {stale}"
        # Every write after the pause bounces as NotLeaderError. The one write that can
        # end otherwise is the one in flight when SIGSTOP landed: its gRPC deadline runs
        # out while the process is stopped, so it fails as unavailable on resume.
        first_rejected = min(int(ln[1]) for ln in lines if ln[0] == "rejected")
        errors = [ln for ln in lines if ln[0] == "error"]
        assert all(int(ln[1]) == first_rejected - 1 for ln in errors), f"errors: {errors}"
        assert etcd_client.get(target).value == b"successor"  # type: ignore[union-attr]
        assert successor.is_leader
    finally:
        procs.signal_group(child, signal.SIGCONT)
        successor.resign()


def test_a_stray_key_without_a_lease_does_not_block_the_election(
    etcd_client: EtcdClient,
) -> None:
    stray = etcd_client.keys.election_prefix("coord") + "0000000000000001"
    etcd_client.put(stray, b"left over by hand")
    election = Election(etcd_client, "coord", value=b"real", ttl_s=2)
    try:
        election.campaign(timeout=5)
        assert election.is_leader
        leader = election.leader()
        assert leader is not None and leader.value == b"real"
    finally:
        election.resign()
