"""Plain torchrun on the etcd-v3 rendezvous: nodes die and join, the job goes on.

Real torchrun processes ("nodes") on loopback, a real etcd, a DDP script with
no tidal code in it (examples/elastic_ddp.py) training over gloo. This is the
scenario in which torch 2.13's own c10d backend split the job in two, died
with its first node, or left a joining node waiting for a MASTER_ADDR that
nobody published again (see docs/architecture.md, "Rendezvous").
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from examples.torchrun_scenario import (
    TorchrunCluster,
    descendants,
    run_kill_and_join,
    wait_until,
)
from rendezvous.etcd.server import EtcdServer

log = logging.getLogger(__name__)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_survivor_continues_after_the_first_node_dies_and_a_joiner_enters_the_same_group(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TIDAL_ETCD_ROOT", etcd_root)
    cluster = TorchrunCluster(
        workdir=tmp_path, etcd_endpoint=etcd_server.endpoint, run_id="plugin-job", nnodes="1:2"
    )
    orphans: list[int] = []
    original_kill = cluster.kill_node

    def kill_and_remember(name: str) -> None:
        orphans.extend(descendants(cluster.nodes[name].pid))
        original_kill(name)

    cluster.kill_node = kill_and_remember  # type: ignore[method-assign]
    try:
        result = run_kill_and_join(cluster, say=log.info)
    except Exception:
        for name in cluster.nodes:
            log.error("node %s log:\n%s", name, cluster.log_tail(name, 60))
        raise
    finally:
        cluster.kill_all()

    records = result.records
    by_node = {n: [r for r in records if r["node"] == n] for n in ("a", "b", "c")}

    # Both first nodes trained together at world size 2.
    assert any(r["world_size"] == 2 for r in by_node["a"])
    # Killing the node that created the rendezvous did not end the job: the
    # survivor resumed from its checkpoint, losing at most the step in flight.
    assert result.first_step_after_kill >= result.last_step_before_kill
    # The joiner entered the survivor's group: it never trained alone (no second
    # group) and it continued from the survivor's step, not from zero.
    assert by_node["c"], "node c never trained"
    assert {r["world_size"] for r in by_node["c"]} == {2}
    assert by_node["c"][0]["step"] > result.first_step_after_kill
    # While b and c trained together, each step was taken once by each rank of one group.
    joined = [r for r in records if r["time"] >= by_node["c"][0]["time"] and r["world_size"] == 2]
    steps_per_node = {n: [r["step"] for r in joined if r["node"] == n] for n in ("b", "c")}
    common = set(steps_per_node["b"]) & set(steps_per_node["c"])
    assert common, steps_per_node
    for n in ("b", "c"):
        steps = steps_per_node[n]
        assert steps == sorted(steps) and len(steps) == len(set(steps)), (n, steps)
    # Every rank of the two-node group agrees on the ranks: 0 and 1, once each per step.
    for step in common:
        ranks = sorted(r["rank"] for r in joined if r["step"] == step)
        assert ranks == [0, 1], (step, ranks)
    # The killed node left nothing running.
    assert orphans, "node a had no processes to kill?"
    alive = [pid for pid in orphans if Path(f"/proc/{pid}").exists() and _not_zombie(pid)]
    assert alive == []
    log.info(
        "kill -> first step at size 1: %.1f s; join -> first step at size 2: %.1f s",
        result.kill_to_first_step_s,
        result.join_to_first_step_s,
    )


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_rides_out_an_etcd_restart_without_restarting_workers(
    tmp_path: Path, fresh_etcd: EtcdServer
):
    # torch's agent polls the rendezvous from its monitor loop and dies on the
    # first backend error; the etcd-v3 backend retries through an outage.
    cluster = TorchrunCluster(
        workdir=tmp_path / "job", etcd_endpoint=fresh_etcd.endpoint, run_id="outage", nnodes="2:2"
    )
    try:
        started = time.time()
        cluster.start_node("a")
        cluster.start_node("b")
        cluster.wait_for_world({"a", "b"}, 2, after=started, timeout=120)
        fresh_etcd.kill()
        killed = time.time()
        # Workers train on without etcd: both nodes keep logging steps.
        wait_until(
            lambda: _nodes_with_steps_after(cluster, killed, 10) >= {"a", "b"},
            timeout=60,
            what="10 steps per node while etcd is down",
        )
        down_for = time.time() - killed
        fresh_etcd.start()
        back = time.time()
        wait_until(
            lambda: _nodes_with_steps_after(cluster, back + 3, 5) >= {"a", "b"},
            timeout=60,
            what="5 steps per node, 3 s after etcd came back",
        )
        for name in ("a", "b"):
            assert cluster.nodes[name].poll() is None, cluster.log_tail(name)
        after = [r for r in cluster.records() if r["time"] >= killed]
        assert {(r["world_size"], r["restarts"]) for r in after} == {(2, 0)}
        log.info("etcd was down %.1f s; no worker restarted", down_for)
    finally:
        cluster.kill_all()


def _nodes_with_steps_after(cluster: TorchrunCluster, since: float, count: int) -> set[str]:
    per_node: dict[str, int] = {}
    for r in cluster.records():
        if r["time"] >= since:
            per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    return {n for n, c in per_node.items() if c >= count}
