"""A runner's spec file and environment, and the warm runner's hand-over (agent.node.launch)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from agent.node.launch import WarmRunner, _Warm, runner_env, write_spec
from agent.node.settings import AgentSettings
from agent.node.warm_policy import WARM_REFILL_DELAY_S, WARM_RETRY_S, WarmTimer
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


def waiting_process(tmp_path: Path) -> _Warm:
    """A stand-in for a warm runner: reads one line (the spec's path) and exits with it."""
    log_path = tmp_path / "warm.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('got', sys.stdin.readline().strip())"],
            stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT)
    return _Warm(process, log_path)


def test_a_job_takes_the_warm_runner_and_its_log_and_the_next_comes_later(
    tmp_path: Path,
) -> None:
    keeper = WarmRunner(settings(tmp_path), clock=lambda: 100.0)
    keeper.timer = WarmTimer(retry_s=4 * WARM_RETRY_S)
    keeper._warm = warm = waiting_process(tmp_path)
    job_log = tmp_path / "runner.log"
    try:
        taken = keeper.take("j", tmp_path / "spec.json", job_log)
        assert taken == (warm.process, job_log)
        assert warm.process.wait(timeout=30) == 0
        assert f"got {tmp_path / 'spec.json'}" in job_log.read_text()
        assert keeper.timer == WarmTimer(due=100.0 + WARM_REFILL_DELAY_S, retry_s=WARM_RETRY_S)
        assert keeper.take("k", tmp_path / "spec.json", job_log) is None  # none left
    finally:
        warm.process.kill()
        warm.process.wait()


def test_a_job_finding_the_warm_runner_dead_starts_cold(tmp_path: Path) -> None:
    keeper = WarmRunner(settings(tmp_path), clock=lambda: 7.0)
    keeper._warm = warm = waiting_process(tmp_path)
    warm.process.kill()
    warm.process.wait()
    assert keeper.take("j", tmp_path / "spec.json", tmp_path / "runner.log") is None
    assert keeper.timer.due == 7.0 + WARM_REFILL_DELAY_S


def test_a_discarded_warm_runner_gets_end_of_file_and_its_log_goes(tmp_path: Path) -> None:
    keeper = WarmRunner(settings(tmp_path))
    keeper._warm = warm = waiting_process(tmp_path)
    try:
        keeper.discard()
        assert warm.process.returncode == 0
        assert not warm.log_path.exists()
    finally:
        if warm.process.poll() is None:
            warm.process.kill()
            warm.process.wait()
