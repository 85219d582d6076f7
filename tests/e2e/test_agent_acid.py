"""The acid test through real agents: kill a node, add one, get the same parameters.

Three `tidal agent` processes run examples/mlp.py (float64, the checkpoints
library, DDP over gloo) as one job with min 1 and max 3 nodes. One agent is
SIGKILLed mid-training, a fourth joins, the job completes; its final
parameters must equal those of the same job run uninterrupted at world size 2
under plain torchrun.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rendezvous.client import EtcdClient
from rendezvous.etcd_server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import AgentCluster, assign, processes_of_node, statuses, unassign
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
ARGS = [
    "--total-steps", "60", "--global-batch-size", "10", "--dataset-size", "96",
    "--dtype", "float64", "--every-steps", "2", "--seed", "5",
]


def _params(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        name: torch.tensor(p["values"], dtype=torch.float64).reshape(p["shape"])
        for name, p in record["params"].items()
    }


def _reference(tmp_path: Path, procs: ProcessGroupRegistry) -> dict[str, Any]:
    record = tmp_path / "reference.json"
    proc = procs.spawn(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(MLP), "--checkpoint-dir", str(tmp_path / "ref-ckpt"), *ARGS, "--record", str(record)],
        log_path=tmp_path / "reference.log",
    )
    assert proc.wait(timeout=180) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    return dict(json.loads(record.read_text()))


def _state(client: EtcdClient, nodes: set[str], *, size: int | None = None,
           state: JobNodeState = JobNodeState.RUNNING, min_step: int = 0) -> bool:
    st = statuses(client, "mlp")
    return nodes <= set(st) and all(
        st[n].state == state
        and (size is None or st[n].world_size == size)
        and (st[n].last_step or 0) >= min_step
        for n in nodes
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agents_losing_and_gaining_nodes_end_with_the_uninterrupted_parameters(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    reference = _reference(tmp_path, procs)
    cluster = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    record = tmp_path / "elastic.json"
    job = Assignment(
        job_id="mlp",
        command=[sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"), *ARGS,
                 "--step-seconds", "0.15", "--record", str(record)],
        min_nodes=1, max_nodes=3, max_restarts=3, grace_period_s=10,
    )
    try:
        for node in ("a", "b", "c"):
            cluster.start_agent(node)
            assign(etcd_client, node, job)
        wait_for(lambda: _state(etcd_client, {"a", "b", "c"}, size=3, min_step=6), timeout=120,
                 what="world size 3, step 6")
        cluster.kill_agent("c")
        unassign(etcd_client, "c", "mlp")
        wait_for(lambda: not processes_of_node("c", warm=True), timeout=10,
                 what="node c's processes gone")
        wait_for(lambda: _state(etcd_client, {"a", "b"}, size=2), timeout=120,
                 what="a and b at world size 2")
        cluster.start_agent("d")
        assign(etcd_client, "d", job)
        wait_for(lambda: _state(etcd_client, {"a", "b", "d"}, size=3), timeout=120,
                 what="a, b, d at world size 3")
        wait_for(lambda: _state(etcd_client, {"a", "b", "d"}, state=JobNodeState.SUCCEEDED),
                 timeout=180, what="the job succeeded on a, b, d")
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    elastic = json.loads(record.read_text())
    assert elastic["world_size"] == 3
    got, want = _params(elastic), _params(reference)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    log.info("max abs parameter difference vs the uninterrupted run: %.3g", diff)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-10, rtol=0)
