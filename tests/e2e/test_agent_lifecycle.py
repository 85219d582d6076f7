"""Cancel and failure through real agents: nothing left running, causes reported."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer, free_port
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import (
    ELASTIC_DDP,
    AgentCluster,
    assign,
    processes_of_node,
    statuses,
    unassign,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

BUGGY = """
import os, sys
step = 0
print("training", flush=True)
def load(path):
    raise ValueError(f"corrupt shard {path!r}")
load("/data/shard-3")
"""


@pytest.fixture
def cluster(tmp_path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry):
    return AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )


def _workers_of(node_id: str) -> list[int]:
    """The node's processes other than its job runners and their zygotes."""
    pids = []
    for pid in processes_of_node(node_id):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"agent.runner.elastic" not in cmdline and b"agent.workers.zygote" not in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.slow  # 29 s under load
def test_cancel_stops_every_worker_within_the_grace_period(
    cluster: AgentCluster, etcd_client: EtcdClient, tmp_path: Path
):
    job = Assignment(
        job_id="cancel-me",
        command=[sys.executable, str(ELASTIC_DDP), "--checkpoint", str(tmp_path / "c.pt"),
                 "--step-seconds", "0.1"],
        min_nodes=1, max_nodes=1, grace_period_s=5,
    )
    port = free_port()
    cluster.start_agent("a", metrics_port=port)
    assign(etcd_client, "a", job)
    wait_for(lambda: statuses(etcd_client, "cancel-me").get("a") is not None
             and statuses(etcd_client, "cancel-me")["a"].state == JobNodeState.RUNNING,
             timeout=90, what="the job running on a")
    # The agent's /metrics shows the node and the job (a plain 200, no redirect).
    page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert page.status_code == 200
    assert "tidal_agent_up 1.0" in page.text
    assert 'tidal_agent_job_world_size{job_id="cancel-me"} 1.0' in page.text
    assert 'tidal_agent_job_state{job_id="cancel-me",state="running"} 1.0' in page.text
    assert "tidal_agent_slots_used 1.0" in page.text
    wait_for(lambda: len(processes_of_node("a")) >= 2, timeout=30, what="runner and worker up")
    cancelled = time.monotonic()
    unassign(etcd_client, "a", "cancel-me")
    # The workers get SIGTERM, then SIGKILL once the grace period is over. Slack: the
    # agent's watch, its SIGTERM and the runner's own on a loaded 2-core machine (over
    # 5 s once, with the full suite's other worker on the scenario tests).
    slack_s = 15
    try:
        wait_for(lambda: not _workers_of("a"), timeout=job.grace_period_s + slack_s,
                 what="workers gone")
        # ...and the runner, after leaving the rendezvous, is killed by the agent
        # at the latest grace + 10 s after the SIGTERM.
        wait_for(lambda: not processes_of_node("a"), timeout=job.grace_period_s + 10 + slack_s,
                 what="the runner gone too")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{cluster.log_tails(15)}") from exc
    assert time.monotonic() - cancelled < job.grace_period_s + 10 + slack_s
    wait_for(lambda: statuses(etcd_client, "cancel-me")["a"].state == JobNodeState.CANCELLED,
             timeout=10, what="status cancelled")
    # The agent itself is still alive and registered.
    assert cluster.agents["a"].poll() is None


@pytest.mark.slow  # 43 s under load: workers restarted on their budget
def test_a_buggy_script_fails_after_its_budget_with_the_traceback_in_status(
    cluster: AgentCluster, etcd_client: EtcdClient
):
    job = Assignment(
        job_id="buggy", command=[sys.executable, "-c", BUGGY],
        min_nodes=1, max_nodes=1, max_restarts=1,
    )
    cluster.start_agent("a")
    assign(etcd_client, "a", job)
    wait_for(lambda: (s := statuses(etcd_client, "buggy").get("a")) is not None
             and s.state == JobNodeState.FAILED,
             timeout=120, what="the job failed on a")
    status = statuses(etcd_client, "buggy")["a"]
    assert status.error is not None
    assert status.error.exit_code == 1
    assert "ValueError: corrupt shard '/data/shard-3'" in status.error.traceback
    assert status.restart_count == 2  # the first failure and the one after the single restart
    assert status.remaining_restarts == 0
    # It does not loop: the runner is gone, and the agent does not rerun the generation.
    wait_for(lambda: not processes_of_node("a"), timeout=15, what="runner gone")
    assert statuses(etcd_client, "buggy")["a"].state == JobNodeState.FAILED
