"""The acid test with rare checkpoints: a node SIGKILLed after a save costs one step at most.

Three `tidal agent` processes run examples/mlp.py (float64, the checkpoints
library, DDP over gloo) with a periodic checkpoint only every 50 steps. Node
c is SIGKILLed a few steps after step 50's checkpoint; the survivors' workers
save the last completed step just in time, and a and b resume from it (or
the step before) at world size 2 instead of from step 50. The job's final
parameters must equal those of the same job run uninterrupted under plain
torchrun.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.acid import (
    MLP,
    assert_same_params,
    max_difference,
    record_params,
    start_reference,
    wait_reference,
)
from tests.support.agents import (
    AgentCluster,
    assign,
    nodes_in_state,
    processes_of_node,
    unassign,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
EVERY = 50
ARGS = [
    "--total-steps", "80", "--global-batch-size", "10", "--dataset-size", "96",
    "--dtype", "float64", "--every-steps", str(EVERY), "--seed", "5",
]


def _worker_lines(root: Path, node: str) -> list[str]:
    lines: list[str] = []
    for path in sorted((root / node).rglob("*.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_node_costs_the_survivors_at_most_one_step_with_every_steps_50(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    ref, reference_record = start_reference(procs, tmp_path, ARGS)
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
        wait_for(lambda: nodes_in_state(etcd_client, "mlp", {"a", "b", "c"}, size=3,
                                            min_step=EVERY + 3),
                 timeout=240, what=f"world size 3, step {EVERY + 3}")
        cluster.kill_agent("c")
        unassign(etcd_client, "c", "mlp")
        wait_for(lambda: not processes_of_node("c", warm=True), timeout=10,
                 what="node c's processes gone")
        wait_for(lambda: nodes_in_state(etcd_client, "mlp", {"a", "b"},
                                            state=JobNodeState.SUCCEEDED),
                 timeout=240, what="the job succeeded on a and b")
        wait_reference(ref, tmp_path, timeout=180)
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    lines = _worker_lines(tmp_path, "a") + _worker_lines(tmp_path, "b")
    # mlp.py logs "step S" for the step with index S: S + 1 steps are then complete.
    done = max(int(m.group(1)) + 1 for line in lines
               if (m := re.search(r"world_size 3 step (\d+) loss", line)))
    resumed = [int(m.group(1)) for line in lines
               if (m := re.search(r"start at step (\d+) .*world_size 2$", line))]
    log.info("last step completed at world size 3: %d; resumed at %s", done, resumed)
    assert resumed and done > EVERY
    assert all(done - 1 <= r <= done for r in resumed), (done, resumed)
    assert any("just-in-time save of step" in line for line in lines)

    got, want = record_params(record), record_params(reference_record)
    log.info("max abs parameter difference vs the uninterrupted run: %.3g",
             max_difference(got, want))
    assert_same_params(got, want)
