"""Queues with real agents: a borrower gives its borrowed nodes back gracefully.

Queues A (guaranteed 2 slots) and B (guaranteed 1) on three one-slot agents.
B's elastic job (1..3 nodes) fills the idle cluster; A submits a job of 2
nodes: the scheduler shrinks B's job to 1 node (a graceful resize: SIGTERM,
checkpoint at a step boundary, restart smaller) and starts A's on the two
nodes given back. A trains at 2 nodes, B goes on at 1, and B resumes from the
step after the last one it completed at 3 nodes: no completed step is lost.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_scheduler import _START, _STEP, MLP
from tests.support.agents import AgentCluster
from tests.support.coordinator import CoordinatorProcess, job_view
from tests.support.wait import wait_for


def _job_logs(root: Path, job_id: str) -> list[str]:
    lines: list[str] = []
    for path in sorted(root.glob(f"*/jobs/{job_id}/gen-*/logs/**/stderr.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


def _running_at(api: httpx.Client, job_id: str, size: int) -> bool:
    view = job_view(api, job_id)
    return bool(view["phase"] == "RUNNING" and view["world_size"] == size)


def _mlp(tmp_path: Path, name: str, queue: str, low: int, high: int) -> dict[str, object]:
    return {
        "name": name, "queue": queue, "min_nodes": low, "max_nodes": high,
        "grace_period_s": 20,
        "command": [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"),
                    "--total-steps", "100000", "--global-batch-size", "12",
                    "--every-steps", "100000", "--step-seconds", "0.1"],
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_guaranteed_job_reclaims_borrowed_nodes_and_the_borrower_loses_no_step(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster]
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    for node in ("a", "b", "c"):
        agents.start_agent(node)
    for name, guaranteed in (("A", 2), ("B", 1)):
        made = api.post("/v1/queues", json={"name": name, "guaranteed": guaranteed})
        assert made.status_code == 201, made.text
    wait_for(lambda: len(api.get("/v1/nodes").json()) == 3, timeout=60, what="three agents")

    b_job = api.post("/v1/jobs", json=_mlp(tmp_path, "b-elastic", "B", 1, 3)).json()["job_id"]
    wait_for(lambda: _running_at(api, b_job, 3), timeout=120, what="B's job on all 3 nodes")
    wait_for(lambda: (job_view(api, b_job)["last_step"] or 0) >= 5, timeout=60,
             what="5 steps of B's job")

    a_job = api.post("/v1/jobs", json=_mlp(tmp_path, "a-rigid", "A", 2, 2)).json()["job_id"]
    wait_for(lambda: _running_at(api, a_job, 2), timeout=180, what="A's job at 2 nodes")
    wait_for(lambda: _running_at(api, b_job, 1), timeout=120, what="B's job at 1 node")
    a_nodes = {n["node_id"] for n in job_view(api, a_job)["nodes"]}
    b_nodes = {n["node_id"] for n in job_view(api, b_job)["nodes"]}
    assert len(a_nodes) == 2 and len(b_nodes) == 1 and not a_nodes & b_nodes

    events = api.get(f"/v1/jobs/{b_job}/events").json()["events"]
    [shrink] = [e for e in events if e["reason"] == "reclaimed"]
    assert f"for job {a_job} of queue A" in shrink["message"]
    assert "preempted" not in [e["reason"] for e in events]

    def resumed_at_1() -> int | None:
        for line in _job_logs(tmp_path, b_job):
            match = _START.search(line)
            if match and match.group(2) == "1":
                return int(match.group(1))
        return None

    resumed = wait_for(resumed_at_1, timeout=60, what="B's worker resuming at world size 1")
    # The reclaim may shrink B 3 -> 1 at once, or 3 -> 2 -> 1 as A's nodes come free
    # one by one: the last step before world size 1 is the newest at any larger size.
    last_before = max(
        int(m.group(3)) for line in _job_logs(tmp_path, b_job)
        if (m := _STEP.search(line)) and m.group(2) != "1"
    )
    # Steps are numbered from 0: resuming at step N means N steps were kept.
    assert resumed == last_before + 1, (resumed, last_before)
    wait_for(lambda: (job_view(api, a_job)["last_step"] or 0) >= 3, timeout=60,
             what="A's job training")
    queues = {q["name"]: q for q in api.get("/v1/queues").json()["queues"]}
    assert (queues["A"]["in_use"], queues["A"]["borrowed"]) == (2, 0)
    assert (queues["B"]["in_use"], queues["B"]["borrowed"]) == (1, 0)
    wait_for(lambda: job_view(api, a_job)["conditions"] and any(
        c["type"] == "Training" and c["status"] for c in job_view(api, a_job)["conditions"]),
        timeout=60, what="A's Training condition")

    def first_steps() -> str | None:
        text = httpx.get(f"{coordinator.url}/metrics", timeout=5).text
        done = 'tidal_coordinator_queue_first_step_seconds_count{queue="A"} 1.0' in text
        return text if done else None

    metrics = wait_for(first_steps, timeout=30, what="A's submit-to-first-step observed")
    assert 'tidal_coordinator_queue_reclaims_total{action="shrink",queue="B"} 1.0' in metrics
    assert 'tidal_coordinator_queue_first_step_seconds_count{queue="B"} 1.0' in metrics
