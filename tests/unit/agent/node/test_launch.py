"""A runner's spec file and environment (agent.node.launch); the warm runner's hand-over,
with real processes, is in tests/integration/agent/node/test_launch.py."""

from __future__ import annotations

import stat
from pathlib import Path

from agent.node.launch import runner_env, write_spec
from agent.node.settings import AgentSettings
from agent.spec import RunnerSpec
from agent.workers.user import ENV_WORKER_USER
from checkpoints.protocol import env as worker_env
from rendezvous.etcd.settings import ETCD_PASSWORD
from rendezvous.records import Assignment


def settings(tmp_path: Path, **extra: object) -> AgentSettings:
    return AgentSettings(node_id="n1", run_dir=tmp_path, **extra)  # type: ignore[arg-type]


def test_the_spec_is_private_to_the_agents_user(tmp_path: Path) -> None:
    s = settings(tmp_path)
    spec = RunnerSpec(
        assignment=Assignment(job_id="j", command=["true"], min_nodes=1, max_nodes=1),
        node_id="n1", address="127.0.0.1", etcd=s.etcd_config(), job_dir=tmp_path,
        parent_pid=1, log_max_bytes=1024, lease_ttl_s=5,
    )
    path = tmp_path / "spec.json"
    write_spec(spec, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("an older, longer spec that must not survive " * 100)
    write_spec(spec, path)
    assert RunnerSpec.model_validate_json(path.read_text()) == spec


def test_the_runner_is_marked_as_the_nodes_and_the_jobs_and_gets_the_password(
    tmp_path: Path,
) -> None:
    env = runner_env(settings(tmp_path, etcd_password="pw", worker_user="nobody"), "j")
    assert env[worker_env.NODE_ID] == "n1"
    assert env[worker_env.JOB_ID] == "j"
    assert env[ETCD_PASSWORD] == "pw"
    assert env[ENV_WORKER_USER] == "nobody"
    warm = runner_env(settings(tmp_path), None)
    assert worker_env.JOB_ID not in warm and ETCD_PASSWORD not in warm
