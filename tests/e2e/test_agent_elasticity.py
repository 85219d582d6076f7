"""Real agents, real runners and workers, real etcd: kill a node, add a node.

Three `tidal agent` processes run one job (min 1, max 3) of the plain DDP
example over gloo. One agent's process group is SIGKILLed: its workers must
die with it (torch starts them in sessions of their own), the other two go on
at world size 2 without the loss being charged to the restart budget; a fourth
agent is assigned and the job grows back to 3, then finishes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState, RestartReason
from tests.support.agents import (
    ELASTIC_DDP,
    AgentCluster,
    assign,
    processes_of_node,
    read_events,
    statuses,
    unassign,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)


def _job(workdir: Path, job_id: str, *, max_steps: int, max_restarts: int = 2) -> Assignment:
    return Assignment(
        job_id=job_id,
        command=[
            sys.executable, str(ELASTIC_DDP),
            "--checkpoint", str(workdir / "ckpt-{node}.pt"),
            "--events", str(workdir / "events.jsonl"),
            "--step-seconds", "0.1",
            "--max-steps", str(max_steps),
        ],
        cwd=str(workdir),
        min_nodes=1,
        max_nodes=3,
        max_restarts=max_restarts,
        grace_period_s=10,
    )


def _world(client: EtcdClient, job_id: str, nodes: set[str], size: int) -> bool:
    st = statuses(client, job_id)
    return nodes <= set(st) and all(
        st[n].state == JobNodeState.RUNNING and st[n].world_size == size for n in nodes
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_job_shrinks_when_an_agent_dies_and_grows_when_one_joins(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    cluster = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    job = _job(tmp_path, "elastic", max_steps=100_000)
    try:
        for node in ("a", "b", "c"):
            cluster.start_agent(node)
            assign(etcd_client, node, job)
        wait_for(lambda: _world(etcd_client, "elastic", {"a", "b", "c"}, 3), timeout=120,
                 what="world size 3 on a, b, c")
        assert processes_of_node("c"), "node c runs no workers?"

        killed_at = time.time()
        cluster.kill_agent("c")
        # The dead agent's runner and workers die with it (parent-death signal).
        wait_for(lambda: not processes_of_node("c", warm=True), timeout=10,
                 what="node c's processes gone")
        unassign(etcd_client, "c", "elastic")  # what the coordinator does on node loss
        wait_for(lambda: _world(etcd_client, "elastic", {"a", "b"}, 2), timeout=120,
                 what="a and b at world size 2")
        events = read_events(tmp_path / "events.jsonl")
        wait_for(
            lambda: any(r["world_size"] == 2 and r["time"] > killed_at
                        for r in read_events(tmp_path / "events.jsonl")),
            timeout=60, what="a step at world size 2",
        )
        st = statuses(etcd_client, "elastic")
        for node in ("a", "b"):
            # The lost peer was not charged to the job's restart budget.
            assert st[node].remaining_restarts == job.max_restarts, st[node]
            assert st[node].restart_reasons.get(RestartReason.NODE_LOST.value, 0) >= 1, st[node]

        cluster.start_agent("d")
        assign(etcd_client, "d", job)
        wait_for(lambda: _world(etcd_client, "elastic", {"a", "b", "d"}, 3), timeout=120,
                 what="a, b, d at world size 3")
        events = read_events(tmp_path / "events.jsonl")
        last = max(r["step"] for r in events)
        wait_for(
            lambda: max(r["step"] for r in read_events(tmp_path / "events.jsonl")) >= last + 5,
            timeout=60, what="5 more steps at world size 3",
        )
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    # Nothing of any node is left once the agents are gone.
    for node in ("a", "b", "d"):
        cluster.kill_agent(node)
    wait_for(lambda: not any(processes_of_node(n, warm=True) for n in "abcd"), timeout=15,
             what="every agent's processes gone")


def _signal_node(cluster: AgentCluster, node: str, sig: int) -> None:
    """Signal a node's agent group and every runner and worker of it (own sessions)."""
    cluster.procs.signal_group(cluster.agents[node], sig)
    for pid in processes_of_node(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hung_node_is_dropped_quickly_and_its_return_does_not_corrupt_the_job(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    cluster = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    job = _job(tmp_path, "hung", max_steps=100_000)
    events = tmp_path / "events.jsonl"
    stopped = False
    try:
        for node in ("a", "b", "c"):
            cluster.start_agent(node)
            assign(etcd_client, node, job)
        wait_for(lambda: _world(etcd_client, "hung", {"a", "b", "c"}, 3), timeout=120,
                 what="world size 3")
        _signal_node(cluster, "c", signal.SIGSTOP)
        stopped = True
        frozen_at = time.time()
        # gloo alone would wait for its collective timeout (the script's: 30 s;
        # torch's default: 30 min); the agents drop the silent peer sooner.
        first = wait_for(
            lambda: next((r for r in read_events(events)
                          if r["time"] > frozen_at and r["world_size"] == 2), None),
            timeout=60, what="a step at world size 2 without the hung node",
        )
        log.info("hung node dropped: first step at world size 2 after %.1f s",
                 first["time"] - frozen_at)
        assert first["time"] - frozen_at < 30  # sooner than the script's own gloo timeout
        _signal_node(cluster, "c", signal.SIGCONT)
        stopped = False
        resumed_at = time.time()
        # The job goes on: steps keep advancing, each step once per rank of one group.
        wait_for(
            lambda: len({r["step"] for r in read_events(events) if r["time"] > resumed_at}) >= 10,
            timeout=120, what="10 more steps after the hung node resumed",
        )
        after = [r for r in read_events(events) if r["time"] > resumed_at]
        by_step: dict[tuple[int, int], list[int]] = {}
        for r in after:
            by_step.setdefault((r["step"], r["world_size"]), []).append(r["rank"])
        st = statuses(etcd_client, "hung")
        assert not any(s.state == JobNodeState.FAILED for s in st.values()), st
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    finally:
        if stopped:
            _signal_node(cluster, "c", signal.SIGCONT)
