"""The runner's live path on real agents, runners and etcd, with stand-in workers.

The workers are :mod:`tests.support.live_standin`: they speak the live path's
files (checkpoints.live) and train nothing, so that what is tested is the
runner's side: a join and a planned leave taken live without restarting the
workers of the nodes that stay, and the fallback to the restart path, with
its cause in the status, when a worker dies in the live path.
tests/e2e/test_live_resize.py runs the changes with real training, and a
script that does not take the live path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import AgentCluster, assign, job_record_for, statuses, unassign
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

JOB = "standin"


def _job(run_dir: Path, *args: str) -> Assignment:
    command = [sys.executable, "-m", "tests.support.live_standin", *args]
    # A leaving stand-in exits once a worker of another node acts on the new round.
    peers = str(run_dir / "*" / "jobs" / JOB / "gen-*" / "progress" / "live-*.json")
    return Assignment(job_id=JOB, command=command, env={"STANDIN_PEERS": peers},
                      cwd=str(Path(__file__).resolve().parents[2]), min_nodes=1, max_nodes=3,
                      max_restarts=2, grace_period_s=20)


def _at(client: EtcdClient, nodes: set[str], size: int) -> bool:
    st = statuses(client, JOB)
    return nodes <= set(st) and all(
        st[n].state == JobNodeState.RUNNING and st[n].world_size == size for n in nodes
    )


def _worker_pid(run_dir: Path, node: str) -> int | None:
    """The pid in the node's live-0.json (the stand-in writes it when it starts)."""
    for path in (run_dir / node).glob(f"jobs/{JOB}/gen-*/progress/live-0.json"):
        try:
            return int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def _resizes(run_dir: Path, node: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for path in (run_dir / node).glob(f"jobs/{JOB}/gen-*/metrics.json"):
        for mode, reasons in json.loads(path.read_text()).get("resizes", {}).items():
            for reason, count in reasons.items():
                out.setdefault(mode, {})[reason] = out.get(mode, {}).get(reason, 0) + count
    return out


def _a_and_b_then_c_joins(tmp_path: Path, etcd_server: EtcdServer, etcd_root: str,
                          etcd_client: EtcdClient, procs: ProcessGroupRegistry,
                          job: Assignment) -> dict[str, int | None]:
    """Agents a, b and c; the job on a and b (round 1), then c given it too (round 2).
    Returns the pids of a's and b's workers in round 1."""
    agents = AgentCluster(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                          workdir=tmp_path, procs=procs)
    # The record names a and b before either runner starts: round 1 waits for both.
    etcd_client.put(etcd_client.keys.job(JOB), job_record_for(job, {"a": 1, "b": 1}))
    for node in ("a", "b", "c"):
        agents.start_agent(node)
    for node in ("a", "b"):
        assign(etcd_client, node, job)
    wait_for(lambda: _at(etcd_client, {"a", "b"}, 2), timeout=120,
             what="world size 2 on a and b")
    pids = {n: wait_for(lambda n=n: _worker_pid(tmp_path, n), timeout=30,  # type: ignore[misc]
                        what=f"{n}'s worker ready") for n in ("a", "b")}
    assign(etcd_client, "c", job)
    wait_for(lambda: _at(etcd_client, {"a", "b", "c"}, 3), timeout=120,
             what="world size 3 on a, b, c")
    return pids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_join_and_a_leave_are_live_and_a_worker_that_dies_in_one_falls_back_to_a_restart(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    # Rounds: 1 (a, b), 2 (c joins, live), 3 (c leaves): the workers of a and b
    # exit on the notice of round 3, as a worker that fails in the live path.
    job = _job(tmp_path, "answer", "3")
    pids = _a_and_b_then_c_joins(tmp_path, etcd_server, etcd_root, etcd_client, procs, job)
    st = statuses(etcd_client, JOB)
    for node in ("a", "b"):
        assert (st[node].resize_paths, st[node].last_resize) == ({"live": 1}, "live"), st[node]
        assert st[node].restart_count == 0, st[node]
        assert _worker_pid(tmp_path, node) == pids[node], f"{node}'s worker was restarted"

    unassign(etcd_client, "c", JOB)  # its agent SIGTERMs its runner: a planned leave
    wait_for(lambda: statuses(etcd_client, JOB)["c"].state == JobNodeState.CANCELLED,
             timeout=60, what="c's runner gone")
    wait_for(lambda: _at(etcd_client, {"a", "b"}, 2)
             and statuses(etcd_client, JOB)["a"].resize_paths.get("restart"),
             timeout=120, what="a and b restarted at world size 2")
    st = statuses(etcd_client, JOB)
    for node in ("a", "b"):
        assert st[node].resize_paths == {"live": 1, "restart": 1}, st[node]
        assert st[node].last_resize == "restart (worker_exited)", st[node]
        assert st[node].restart_count == 1, st[node]
        assert st[node].remaining_restarts == job.max_restarts, "a resize charged the budget"
    # The metrics files follow the status records within a second (agent.runner.status).
    for node, counted in (("a", {"live": {"join": 1}, "restart": {"leave": 1}}),
                          ("b", {"live": {"join": 1}, "restart": {"leave": 1}}),
                          ("c", {"live": {"leave": 1}})):
        wait_for(lambda n=node, c=counted: _resizes(tmp_path, n) == c,  # type: ignore[misc]
                 timeout=10, what=f"{node}'s metrics to count its resizes")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_member_lost_during_a_planned_join_turns_the_round_into_an_in_place_recovery(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    """A node saw a join (or leave) just before a member's death: its runner took the
    planned resize, and its workers' collective then failed, so they wait for a round
    marked lost. The runner marks the round it formed lost instead of leaving them to
    time out (30 s) and restarting: the workers keep their processes."""
    # Rounds: 1 (a, b), 2 (c joins): a's and b's stand-ins answer round 2's planned
    # notice "broken", as workers whose all-reduce failed at that moment.
    job = _job(tmp_path, "broken", "2")
    pids = _a_and_b_then_c_joins(tmp_path, etcd_server, etcd_root, etcd_client, procs, job)
    for node in ("a", "b"):
        wait_for(lambda n=node: _resizes(tmp_path, n) == {"live": {"lost": 1}},  # type: ignore[misc]
                 timeout=10, what=f"{node}'s metrics to count one live recovery from a loss")
        st = statuses(etcd_client, JOB)[node]
        assert (st.resize_paths, st.last_resize, st.restart_count) == ({"live": 1}, "live", 0), st
        assert _worker_pid(tmp_path, node) == pids[node], f"{node}'s worker was restarted"
