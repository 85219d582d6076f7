"""Charged restarts against a real etcd and coordinator: counted over the job's
life, one event each, across a node that leaves and rejoins and a coordinator
that is replaced.

Nodes are leased records put straight into etcd and their agents' statuses are
written by hand (no agents), as in ``test_hardening.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import RUNNER_RANK, Assignment, JobNodeState, JobNodeStatus, WorkerError
from rendezvous.registry import NodeInfo, NodeRegistration, NodeRegistry
from tests.support.coordinator import CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

NODE = "n-1"


@pytest.fixture
def node(etcd_client: EtcdClient) -> Iterator[list[NodeRegistration]]:
    held: list[NodeRegistration] = []
    yield held
    for registration in held:
        registration.close()


def _register(etcd_client: EtcdClient, held: list[NodeRegistration]) -> None:
    info = NodeInfo(node_id=NODE, host="h", address="127.0.0.1", slots=1)
    held.append(NodeRegistry(etcd_client).register(info, ttl_s=5))


def _assignment(etcd_client: EtcdClient, job_id: str) -> Assignment | None:
    kv = etcd_client.get(etcd_client.keys.assignment(NODE, job_id))
    return Assignment.model_validate_json(kv.value) if kv is not None else None


def _generation(etcd_client: EtcdClient, job_id: str) -> int | None:
    assignment = _assignment(etcd_client, job_id)
    return assignment.generation if assignment is not None else None


def _report(etcd_client: EtcdClient, job_id: str, generation: int, charged: int) -> None:
    error = WorkerError(rank=RUNNER_RANK, exit_code=-9, signal="SIGKILL",
                        message=f"the runner (pid {100 + charged}) was killed by SIGKILL")
    status = JobNodeStatus(
        job_id=job_id, node_id=NODE, generation=generation, state=JobNodeState.RUNNING,
        world_size=1, restart_count=charged, restart_reasons={"worker_failed": charged},
        remaining_restarts=10 - charged, error=error,
    )
    etcd_client.put(etcd_client.keys.status(job_id, NODE), status.model_dump_json().encode())


def _charged(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    response = api.get(f"/v1/jobs/{job_id}/events")
    assert response.status_code == 200, response.text
    return [e for e in response.json()["events"] if e["reason"] == "restart_charged"]


def _restarts(api: httpx.Client, job_id: str) -> int:
    response = api.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return int(response.json()["restarts"].get("worker_failed", 0))


@pytest.mark.timeout(120)
def test_charged_restarts_add_up_over_a_rejoin_with_one_event_each_across_a_failover(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry, node: list[NodeRegistration],
) -> None:
    def coordinator() -> CoordinatorProcess:
        return CoordinatorProcess(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                                  workdir=tmp_path, procs=procs).start()

    first = coordinator()
    try:
        _register(etcd_client, node)
        with first.client() as api:
            response = api.post("/v1/jobs", json=job_spec(max_restarts=10))
            assert response.status_code == 201, response.text
            job_id = str(response.json()["job_id"])
            a: int = wait_for(lambda: _generation(etcd_client, job_id), timeout=20,
                              what="the assignment")
            _report(etcd_client, job_id, a, 1)
            _report(etcd_client, job_id, a, 2)
            wait_for(lambda: len(_charged(api, job_id)) >= 1 and _restarts(api, job_id) == 2,
                     timeout=20, what="the charges counted")
            # The node leaves (its lease ends) and comes back: a new generation,
            # whose agent counts from 0 again.
            node.pop().close()
            wait_for(lambda: _assignment(etcd_client, job_id) is None, timeout=20,
                     what="the lost node's assignment deleted")
            _register(etcd_client, node)
            b: int = wait_for(lambda: _generation(etcd_client, job_id), timeout=20,
                              what="a new assignment")
            assert b > a
        first.kill()
        second = coordinator()  # a new coordinator, with nothing in memory
        wait_for(second.is_leader, timeout=60, what="the new coordinator leading")
        with second.client() as api:
            _report(etcd_client, job_id, b, 1)

            def told() -> list[dict[str, Any]] | None:
                e = _charged(api, job_id)
                done = len(e) >= 2 and e[-1]["message"].endswith("(pid 101) was killed by SIGKILL")
                return e if done else None

            events = wait_for(told, timeout=20, what="the rejoined node's charge told")
            assert _restarts(api, job_id) == 3
            assert all(e["nodes"] == [NODE] for e in events)
            assert events[-1]["message"].startswith(
                f"the runner failed on {NODE}; restart 1 charged to its budget (9 left)")
            # Once told, never again: one more charge gives one more event.
            _report(etcd_client, job_id, b, 2)
            wait_for(lambda: _restarts(api, job_id) == 4 and len(_charged(api, job_id)) == len(
                events) + 1, timeout=20, what="the next charge")
    except BaseException:
        print(first.log_tail())
        raise
