"""The acid test across hosts: a partition mid-run changes nothing in the final parameters.

examples/mlp.py (float64, the checkpoints library, DDP over gloo between three
agent hosts) runs as one job of min 1, max 3 nodes. Once a few checkpoints
exist, the host holding rank 0 (the one that writes the checkpoints, and the
workers' master) is cut off; the others resume from the newest checkpoint at
world size 2; the link comes back, the host rejoins and the job finishes at
world size 3. Its final parameters must equal those of the same script run
uninterrupted at world size 2 under plain torchrun, within the tolerance of
tests/e2e/test_agent_acid.py.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from tests.netns.cluster import MLP, WORKER_ENV, NetnsCluster
from tests.support.acid import (
    assert_same_params,
    max_difference,
    record_params,
    start_reference,
    wait_reference,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
ARGS = [
    "--total-steps", "400", "--global-batch-size", "10", "--dataset-size", "96",
    "--dtype", "float64", "--every-steps", "2", "--seed", "5",
]


def _last_step(cluster: NetnsCluster, job_id: str) -> int:
    return int(cluster.api.job(job_id)["last_step"] or 0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_partition_mid_run_ends_with_the_uninterrupted_parameters(
    cluster: NetnsCluster, procs: ProcessGroupRegistry, tmp_path: Path
) -> None:
    api = cluster.api
    # The reference runs in the root namespace, on loopback, meanwhile.
    reference, reference_record = start_reference(procs, tmp_path, ARGS)
    record = tmp_path / "elastic.json"
    job_id = api.submit({
        "name": "acid",
        "command": [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"), *ARGS,
                    "--step-seconds", "0.1", "--record", str(record)],
        "env": dict(WORKER_ENV),
        "min_nodes": 1, "max_nodes": 3, "max_restarts": 3, "grace_period_s": 10,
    })
    wait_for(lambda: api.running_at(job_id, 3) and _last_step(cluster, job_id) >= 20,
             timeout=120, interval=0.3, what="world size 3 and step 20")
    victim = cluster.node_of_rank(job_id, 0)
    host = cluster.agent_hosts[victim]
    cluster.net.cut(host)
    try:
        wait_for(lambda: api.running_at(job_id, 2), timeout=90, interval=0.3,
                 what="RUNNING at world size 2 without the cut-off rank-0 host")
        resumed = _last_step(cluster, job_id)
        wait_for(lambda: _last_step(cluster, job_id) >= resumed + 10, timeout=60, interval=0.3,
                 what="10 steps at world size 2")
    finally:
        cluster.net.heal(host)
    wait_for(lambda: api.running_at(job_id, 3), timeout=120, interval=0.3,
             what=f"{victim} back: RUNNING at world size 3")
    assert _last_step(cluster, job_id) < 400, "the job ended before the host rejoined"
    wait_for(lambda: api.job(job_id)["phase"] == "SUCCEEDED", timeout=180, interval=0.5,
             what="the job SUCCEEDED")

    wait_reference(reference, tmp_path, timeout=120)
    want = record_params(reference_record)
    elastic = json.loads(record.read_text())
    assert elastic["world_size"] == 3
    got = record_params(elastic)
    log.info("max abs parameter difference vs the uninterrupted run: %.3g",
             max_difference(got, want))
    view = api.job(job_id)
    assert view["restarts"].get("node_lost", 0) >= 1 and view["restarts"].get("node_joined", 0) >= 1
    assert_same_params(got, want)
