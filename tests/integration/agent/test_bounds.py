"""A runner follows its assignment's bounds on a real etcd (agent.bounds.BoundsFollower)."""

from __future__ import annotations

import threading

from agent.bounds import BoundsFollower
from rendezvous.etcd import EtcdClient
from rendezvous.records import Assignment
from tests.support.wait import wait_for

JOB = Assignment(job_id="bnd", generation=2, command=["python", "-c", "pass"],
                 min_nodes=2, max_nodes=2)


class Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[int, int]] = []

    def __call__(self, min_nodes: int, max_nodes: int) -> None:
        with self.lock:
            self.calls.append((min_nodes, max_nodes))

    def get(self) -> list[tuple[int, int]]:
        with self.lock:
            return list(self.calls)


def _put(client: EtcdClient, key: str, assignment: Assignment) -> None:
    client.put(key, assignment.model_dump_json().encode())


def test_the_follower_reports_the_current_bounds_then_each_rewrite_at_its_generation(
    etcd_client: EtcdClient,
) -> None:
    keys = etcd_client.keys
    key = keys.assignment("a", "bnd")
    _put(etcd_client, key, JOB)
    seen = Seen()
    follower = BoundsFollower(etcd_client, key, JOB.generation, on_change=seen).start()
    try:
        assert follower.wait_synced(10)
        assert seen.get() == [(2, 2)]
        _put(etcd_client, key, JOB.model_copy(update={"min_nodes": 1, "max_nodes": 4}))
        wait_for(lambda: seen.get() == [(2, 2), (1, 4)], timeout=10, what="the new bounds")
        # Written again unchanged, another job's key under the same prefix,
        # another generation, a value that is no assignment, a delete: none is news.
        _put(etcd_client, key, JOB.model_copy(update={"min_nodes": 1, "max_nodes": 4}))
        _put(etcd_client, key + "x", JOB.model_copy(update={"job_id": "bndx", "max_nodes": 9}))
        _put(etcd_client, key, JOB.model_copy(update={"generation": 3, "max_nodes": 7}))
        etcd_client.put(key, b"not an assignment")
        etcd_client.delete(key)
        _put(etcd_client, key, JOB.model_copy(update={"max_nodes": 3}))
        wait_for(lambda: seen.get()[-1] == (2, 3), timeout=10, what="the last bounds")
        assert seen.get() == [(2, 2), (1, 4), (2, 3)]
        assert follower.bounds == (2, 3)
    finally:
        follower.stop()
