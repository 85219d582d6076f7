"""The whole service: a real coordinator scheduling real agents running real DDP over gloo.

* gang start waits for the minimum; the job grows to its maximum when agents
  appear, shrinks when one dies, falls back to PENDING below its minimum and
  comes back when a node returns; cancel stops every worker;
* a scale-down by PATCH drains gracefully: the job resumes at the smaller size
  from the step it had completed, with no completed step lost; a PATCH back up
  lets the released node join again, the runners that stayed going on;
* new bounds that change no membership (min 2 -> 1, max 2 -> 4 with only two
  agents) restart nothing: the same runner and worker processes train on; the
  runners follow the new bounds: a third agent joins without restarting them,
  and one node goes on alone under the new minimum;
* the coordinator is SIGKILLed mid-job: training goes on, and the restarted
  coordinator shows the same job, on the same nodes, without rescheduling it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.records import Assignment
from tests.support.agents import (
    ELASTIC_DDP,
    AgentCluster,
    processes_of_node,
    read_events,
    statuses,
)
from tests.support.coordinator import CoordinatorProcess, job_view
from tests.support.wait import wait_for

MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"




def _running_at(api: httpx.Client, job_id: str, size: int) -> bool:
    view = job_view(api, job_id)
    return view["phase"] == "RUNNING" and view["world_size"] == size


def _reasons(api: httpx.Client, job_id: str) -> list[str]:
    return [e["reason"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["events"]]


def _mlp(tmp_path: Path, *, min_nodes: int, max_nodes: int, global_batch: int,
         grace_s: float) -> dict[str, Any]:
    """examples/mlp.py at 0.1 s a step, saving only when stopped (a SIGTERM)."""
    return {
        "name": "mlp",
        "command": [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--total-steps", "100000", "--global-batch-size", str(global_batch),
                    "--every-steps", "100000", "--step-seconds", "0.1"],
        "min_nodes": min_nodes, "max_nodes": max_nodes, "grace_period_s": grace_s,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gang_start_grow_shrink_pending_and_back(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster]
):
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent("a")
    spec = {
        "name": "elastic",
        "command": [sys.executable, str(ELASTIC_DDP), "--checkpoint", str(tmp_path / "c-{node}.pt"),
                    "--events", str(tmp_path / "events.jsonl"), "--step-seconds", "0.1"],
        "min_nodes": 2, "max_nodes": 3, "grace_period_s": 5,
    }
    job_id = api.post("/v1/jobs", json=spec).json()["job_id"]

    def waiting_for_min() -> bool:
        view = job_view(api, job_id)
        nodes = {n["node_id"] for n in api.get("/v1/nodes").json()}
        scheduled = [c for c in view["conditions"] if c["type"] == "Scheduled"]
        return nodes == {"a"} and bool(scheduled) and scheduled[0]["reason"] == "below_min_nodes"

    wait_for(waiting_for_min, timeout=30, what="the scheduler to see a alone, below min")
    view = job_view(api, job_id)
    assert view["phase"] == "PENDING" and view["nodes"] == []  # gang: not a partial start

    agents.start_agent("b")
    wait_for(lambda: _running_at(api, job_id, 2), timeout=120, what="RUNNING at world size 2")
    agents.start_agent("c")
    wait_for(lambda: _running_at(api, job_id, 3), timeout=120, what="grown to world size 3")

    agents.kill_agent("c")
    wait_for(lambda: not processes_of_node("c", warm=True), timeout=15, what="c's workers gone")
    wait_for(lambda: _running_at(api, job_id, 2), timeout=120, what="shrunk to world size 2")
    assert "node_lost" in _reasons(api, job_id)
    assert job_view(api, job_id)["restarts"].get("node_lost", 0) >= 1

    agents.kill_agent("b")
    wait_for(lambda: job_view(api, job_id)["phase"] == "PENDING", timeout=60,
             what="PENDING below min")
    assert "below_min_nodes" in _reasons(api, job_id)
    agents.start_agent("d")
    wait_for(lambda: _running_at(api, job_id, 2), timeout=120, what="back to RUNNING on a and d")
    assert {n["node_id"] for n in job_view(api, job_id)["nodes"]} == {"a", "d"}

    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    wait_for(lambda: job_view(api, job_id)["phase"] == "CANCELLED", timeout=30, what="CANCELLED")
    wait_for(lambda: not processes_of_node("a") and not processes_of_node("d"), timeout=30,
             what="every worker gone after cancel")


_STEP = re.compile(r"rank (\d+) world_size (\d+) step (\d+) ")
_START = re.compile(r"start at step (\d+) .*world_size (\d+)")


def _rank_logs(root: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted(root.glob("*/jobs/*/gen-*/logs/**/stderr.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_scale_down_by_patch_drains_gracefully_without_losing_a_completed_step(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient
):
    coordinator, agents = cluster
    api = coordinator.client()
    for node in ("a", "b", "c"):
        agents.start_agent(node)
    spec = _mlp(tmp_path, min_nodes=1, max_nodes=3, global_batch=12, grace_s=20)
    job_id = api.post("/v1/jobs", json=spec).json()["job_id"]
    wait_for(lambda: _running_at(api, job_id, 3), timeout=120, what="RUNNING at world size 3")
    wait_for(lambda: (job_view(api, job_id)["last_step"] or 0) >= 5, timeout=60, what="5 steps")

    response = api.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 2})
    assert response.status_code == 200, response.text
    wait_for(lambda: _running_at(api, job_id, 2), timeout=120, what="RUNNING at world size 2")

    def resumed_at_2() -> int | None:
        for line in _rank_logs(tmp_path):
            match = _START.search(line)
            if match and match.group(2) == "2":
                return int(match.group(1))
        return None

    resumed = wait_for(resumed_at_2, timeout=60, what="a worker resuming at world size 2")
    last_at_3 = max(
        int(m.group(3)) for line in _rank_logs(tmp_path)
        if (m := _STEP.search(line)) and m.group(2) == "3"
    )
    # Steps are numbered from 0: resuming at step N means N steps were kept.
    assert resumed == last_at_3 + 1, (resumed, last_at_3)
    assert "scaled_by_user" in _reasons(api, job_id)
    view = job_view(api, job_id)
    assert len(view["nodes"]) == 2 and view["spec"]["max_nodes"] == 2

    # And up again: the released node joins; the two runners that stayed go on.
    stayed = {n: st.pid for n, st in statuses(etcd_client, job_id).items()
              if n in {node["node_id"] for node in view["nodes"]}}
    response = api.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 3})
    assert response.status_code == 200, response.text
    wait_for(lambda: _running_at(api, job_id, 3), timeout=120, what="RUNNING at world size 3")
    assert {n: st.pid for n, st in statuses(etcd_client, job_id).items() if n in stayed} == stayed


_PAIR = ("a", "b")


def _assignments(client: EtcdClient, job_id: str) -> dict[str, Assignment]:
    return {node: Assignment.model_validate_json(kv.value) for node in _PAIR
            if (kv := client.get(client.keys.assignment(node, job_id))) is not None}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_new_bounds_alone_restart_no_runner_and_no_worker(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient
) -> None:
    """Only two agents exist, so min 2 -> 1 and max 2 -> 4 change no membership: both
    assignments are rewritten in place at their generations and every process goes on.
    A third agent then joins under the new maximum, and after two nodes die the first
    goes on alone under the new minimum, without a runner restart."""
    coordinator, agents = cluster
    api = coordinator.client()
    for node in _PAIR:
        agents.start_agent(node)
    spec = _mlp(tmp_path, min_nodes=2, max_nodes=2, global_batch=8, grace_s=10)
    job_id = api.post("/v1/jobs", json=spec).json()["job_id"]
    try:
        wait_for(lambda: (v := job_view(api, job_id))["phase"] == "RUNNING"
                 and v["world_size"] == 2 and (v["last_step"] or 0) >= 3,
                 timeout=120, what="RUNNING at world size 2, 3 steps done")
        before = {node: processes_of_node(node) for node in _PAIR}
        runners = {node: st.pid for node, st in statuses(etcd_client, job_id).items()}
        generations = {n: a.generation for n, a in _assignments(etcd_client, job_id).items()}
        restarts = job_view(api, job_id)["restarts"]
        assert set(generations) == set(_PAIR)
        # Runner, zygote and a worker at least, each.
        assert all(len(pids) >= 3 for pids in before.values()), before
        assert all(runners[node] in before[node] for node in _PAIR), (runners, before)

        response = api.patch(f"/v1/jobs/{job_id}", json={"min_nodes": 1, "max_nodes": 4})
        assert response.status_code == 200, response.text
        wait_for(lambda: {n: (a.generation, a.min_nodes, a.max_nodes)
                          for n, a in _assignments(etcd_client, job_id).items()}
                 == {n: (g, 1, 4) for n, g in generations.items()},
                 timeout=30, what="both assignments rewritten in place with bounds 1..4")
        step = job_view(api, job_id)["last_step"] or 0
        wait_for(lambda: (job_view(api, job_id)["last_step"] or 0) >= step + 10, timeout=60,
                 what="ten more steps after the PATCH")

        assert {node: processes_of_node(node) for node in _PAIR} == before
        assert {n: st.pid for n, st in statuses(etcd_client, job_id).items()} == runners
        view = job_view(api, job_id)
        assert (view["spec"]["min_nodes"], view["spec"]["max_nodes"]) == (1, 4)
        assert view["phase"] == "RUNNING" and view["world_size"] == 2
        assert view["restarts"] == restarts
        events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
        scaled = [e["message"] for e in events if e["reason"] == "scaled_by_user"]
        assert scaled[-1].endswith("nothing restarts"), scaled

        # The running runners took the new maximum over (agent.bounds): a third
        # node now has room in their rendezvous, and joins without a runner restart.
        agents.start_agent("c")
        wait_for(lambda: _running_at(api, job_id, 3), timeout=120, what="grown to world size 3")
        kept = {n: st.pid for n, st in statuses(etcd_client, job_id).items() if n in _PAIR}
        assert kept == runners
        assert {n: a.generation for n, a in _assignments(etcd_client, job_id).items()} \
            == generations

        # And the new minimum: a, started with min 2, goes on alone.
        agents.kill_agent("b")
        agents.kill_agent("c")
        wait_for(lambda: _running_at(api, job_id, 1), timeout=120, what="RUNNING alone on a")
        assert statuses(etcd_client, job_id)["a"].pid == runners["a"]
    except Exception:
        print(agents.log_tails())
        raise


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_coordinator_restart_leaves_the_job_running_and_unchanged(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient
):
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent("a")
    spec = {
        "name": "steady",
        "command": [sys.executable, str(ELASTIC_DDP), "--checkpoint", str(tmp_path / "c.pt"),
                    "--events", str(tmp_path / "events.jsonl"), "--step-seconds", "0.1"],
        "min_nodes": 1, "max_nodes": 1,
    }
    job_id = api.post("/v1/jobs", json=spec).json()["job_id"]
    wait_for(lambda: _running_at(api, job_id, 1), timeout=120, what="RUNNING at world size 1")
    before = job_view(api, job_id)
    assignment_key = etcd_client.keys.assignment("a", job_id)
    assignment = etcd_client.get(assignment_key)
    assert assignment is not None

    coordinator.kill()
    events = tmp_path / "events.jsonl"
    start = max((r["step"] for r in read_events(events)), default=0)
    wait_for(lambda: max((r["step"] for r in read_events(events)), default=0) >= start + 10,
             timeout=60, what="training going on without the coordinator")

    coordinator.start()
    api = coordinator.client()
    after = job_view(api, job_id)
    assert after["phase"] == "RUNNING" and after["nodes"] == [
        {**before["nodes"][0], "last_step": after["nodes"][0]["last_step"]}
    ]
    assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [job_id]
    # Not rescheduled: the same assignment, untouched.
    again = etcd_client.get(assignment_key)
    assert again is not None and again.mod_revision == assignment.mod_revision
