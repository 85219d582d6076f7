"""An agent runs only what the coordinator assigned (issue 12, part 3).

An assignment put into etcd by hand, for a job that does not exist or that
differs from its job's record, never runs: a real agent on a real etcd.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import (
    AgentCluster,
    assign,
    assign_by_hand,
    job_record_for,
    statuses,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for


@pytest.mark.slow  # 25 s under load
def test_an_assignment_put_by_hand_never_runs_its_command(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    cluster = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    cluster.start_agent("a")
    marker = tmp_path / "pwned"
    touch = ["touch", str(marker)]
    # No job record at all: the example.
    assign_by_hand(etcd_client, "a", Assignment(
        job_id="x", generation=1, command=touch, min_nodes=1, max_nodes=1,
    ))
    # A job the coordinator did assign here, but whose assignment was edited since.
    honest = Assignment(job_id="edited", command=["true"], min_nodes=1, max_nodes=1)
    etcd_client.put(etcd_client.keys.job("edited"), job_record_for(honest, {"a": 1}))
    assign_by_hand(etcd_client, "a", honest.model_copy(update={"command": touch}))
    # Then a real assignment. The agent reconciles all of its assignments at
    # once, in the order etcd holds them: once this one has run, the two above
    # were judged (and are judged again while they stay; they stay ignored).
    assign(etcd_client, "a", Assignment(
        job_id="real", command=[sys.executable, "-c", "print('trained')"],
        min_nodes=1, max_nodes=1, max_restarts=0,
    ))
    try:
        wait_for(lambda: (s := statuses(etcd_client, "real").get("a")) is not None
                 and s.state == JobNodeState.SUCCEEDED,
                 timeout=120, what="the real job succeeded on a")
        agent_log = (tmp_path / "agent-a.log").read_text()
        assert f"ignoring assignment {etcd_root}/assignments/a/x (not run): " \
               "job x does not exist" in agent_log
        assert f"ignoring assignment {etcd_root}/assignments/a/edited (not run): " \
               "the assignment of job edited differs from its record in command" in agent_log
    except Exception:
        print(cluster.log_tails())
        raise
    assert not marker.exists()
    jobs = tmp_path / "a" / "jobs"
    assert sorted(p.name for p in jobs.iterdir()) == ["real"]  # no runner was started for them
    assert statuses(etcd_client, "x") == {} and statuses(etcd_client, "edited") == {}
    assert cluster.agents["a"].poll() is None
