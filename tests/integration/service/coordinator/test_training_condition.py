"""The ``Training`` condition with a real agent and real DDP workers: true at the first step.

A job is ``RUNNING`` once its workers start, seconds before they take a step
(imports, rendezvous, restore); ``Training`` says when they did.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from rendezvous.etcd.server import EtcdServer
from tests.support.agents import AgentCluster
from tests.support.coordinator import CoordinatorProcess, job_view
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

# Reports its steps through the checkpoints library (examples/elastic_ddp.py does not).
MLP = Path(__file__).resolve().parents[4] / "examples" / "mlp.py"




def _condition(view: dict[str, Any], type_: str) -> dict[str, Any]:
    """The condition of this type; a false one before the first pass wrote any."""
    found = [c for c in view["conditions"] if c["type"] == type_]
    return found[0] if found else {"status": False}  # type: ignore[no-any-return]


@pytest.mark.slow  # 43 s under load: a job's workers start torch
@pytest.mark.timeout(300)
def test_training_turns_true_when_a_worker_reports_its_first_step(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
):
    coordinator = CoordinatorProcess(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    ).start()
    agents = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    try:
        agents.start_agent("a")
        spec = {
            "name": "steps",
            "command": [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--total-steps", "100000", "--global-batch-size", "4",
                        "--every-steps", "100000", "--step-seconds", "0.1"],
            "min_nodes": 1, "max_nodes": 1,
        }
        with coordinator.client() as api:
            job_id = api.post("/v1/jobs", json=spec).json()["job_id"]
            view = wait_for(
                lambda: (v := job_view(api, job_id))["phase"] == "RUNNING"
                and _condition(v, "Training")["status"] and v,
                timeout=120, what="RUNNING and Training")
            training = _condition(view, "Training")
            assert training["reason"] == "training_started"
            assert view["last_step"] is not None
            started = datetime.fromisoformat(view["started_at"])
            assert datetime.fromisoformat(training["last_transition_time"]) >= started
    except BaseException:
        print(coordinator.log_tail(), agents.log_tails(), sep="\n")
        raise
