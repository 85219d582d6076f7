"""The warm runner's hand-over (agent.node.launch.WarmRunner), with a real process standing
in for the warm runner: taken by a job with its log, found dead, discarded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.node.launch import WarmRunner, _Warm
from agent.node.settings import AgentSettings
from agent.node.warm_policy import WARM_REFILL_DELAY_S, WARM_RETRY_S, WarmTimer


def settings(tmp_path: Path) -> AgentSettings:
    return AgentSettings(node_id="n1", run_dir=tmp_path)


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
