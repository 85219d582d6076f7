"""Two coordinator replicas on one etcd: one leads, the other takes over, nothing runs twice.

Nodes are real leased records in etcd (no agents): what is checked is who
writes assignments, not training.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment
from rendezvous.registry import NodeInfo, NodeRegistration, NodeRegistry
from tests.support.coordinator import CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for


@pytest.fixture
def replicas(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> tuple[CoordinatorProcess, CoordinatorProcess]:
    first = CoordinatorProcess(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                               workdir=tmp_path, procs=procs, name="first").start()
    wait_for(first.is_leader, timeout=15, what="the first replica to lead")
    second = CoordinatorProcess(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                                workdir=tmp_path, procs=procs, name="second").start()
    return first, second


@pytest.fixture
def nodes(etcd_client: EtcdClient) -> Iterator[list[str]]:
    registry = NodeRegistry(etcd_client)
    regs: list[NodeRegistration] = [
        registry.register(NodeInfo(node_id=f"n-{i}", host="h", address="127.0.0.1", slots=1),
                          ttl_s=10)
        for i in range(4)
    ]
    yield [r.info.node_id for r in regs]
    for r in regs:
        r.close()


def _assignments(client: EtcdClient) -> dict[tuple[str, str], Assignment]:
    kvs, _ = client.get_prefix(client.keys.assignments_prefix())
    out = {}
    for kv in kvs:
        a = Assignment.model_validate_json(kv.value)
        node = kv.key[len(client.keys.assignments_prefix()):].split("/")[0]
        out[(node, a.job_id)] = a
    return out


def _placed(client: EtcdClient, job_id: str) -> set[str]:
    return {node for node, job in _assignments(client) if job == job_id}


def test_the_follower_takes_over_within_the_lease_ttl_and_nothing_is_scheduled_twice(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess], nodes: list[str],
    etcd_client: EtcdClient,
):
    first, second = replicas
    assert not second.is_leader()
    with second.client() as api:  # any replica serves the API
        job_a = api.post("/v1/jobs", json=job_spec("a", max_nodes=2)).json()["job_id"]
    wait_for(lambda: len(_placed(etcd_client, job_a)) == 2, timeout=15, what="a on 2 nodes")
    before = _assignments(etcd_client)

    first.kill()
    killed = time.monotonic()
    wait_for(second.is_leader, timeout=15, what="the second replica to lead")
    takeover = time.monotonic() - killed
    assert takeover < 2 + 3, f"takeover took {takeover:.1f} s with a 2 s election TTL"

    with second.client() as api:
        job_b = api.post("/v1/jobs", json=job_spec("b", max_nodes=4)).json()["job_id"]
    wait_for(lambda: len(_placed(etcd_client, job_b)) == 2, timeout=15, what="b on the rest")
    after = _assignments(etcd_client)
    # Job a's assignments are exactly the ones the first leader wrote: not rewritten.
    assert {k: v for k, v in after.items() if k[1] == job_a} == before
    assert _placed(etcd_client, job_a).isdisjoint(_placed(etcd_client, job_b))


def test_a_paused_leader_is_deposed_and_its_writes_are_rejected_after_it_resumes(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess], nodes: list[str],
    etcd_client: EtcdClient,
):
    first, second = replicas
    assert first.process is not None
    os.killpg(first.process.pid, signal.SIGSTOP)
    try:
        wait_for(second.is_leader, timeout=15, what="the second replica to lead")
        with second.client() as api:
            job = api.post("/v1/jobs", json=job_spec("p", max_nodes=3)).json()["job_id"]
        wait_for(lambda: len(_placed(etcd_client, job)) == 3, timeout=15, what="p on 3 nodes")
        placed = _assignments(etcd_client)
    finally:
        os.killpg(first.process.pid, signal.SIGCONT)
    # The deposed leader wakes up believing it leads; etcd refuses its fenced
    # writes and it steps down. Exactly one leader, and the placement stands.
    wait_for(lambda: not first.is_leader(), timeout=15, what="the old leader to step down")
    assert second.is_leader()
    with first.client() as api:  # it still serves the API, reading etcd
        assert api.get(f"/v1/jobs/{job}").json()["phase"] == "RUNNING"
    assert _assignments(etcd_client) == placed
