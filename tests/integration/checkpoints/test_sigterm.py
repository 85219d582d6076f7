"""SIGTERM mid-training: a checkpoint at the next step boundary, exit code 75, no step lost.

Real training processes (one, or two ranks with DDP over gloo) get SIGTERM
while they train; they must save the step they were finishing, exit with
``EXIT_PREEMPTED``, and a restarted job must resume exactly there.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

import checkpoints as ck
from tests.integration.checkpoints.ckpt_worker import worker_argv, worker_env
from tests.support.processes import ProcessGroupRegistry, dump_stacks
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)


def completed_steps(log_path: Path, rank: int) -> list[int]:
    text = log_path.read_text(errors="replace")
    return [int(s) for s in re.findall(rf"^rank {rank} completed step (\d+)$", text, re.M)]


def start_rank(
    procs: ProcessGroupRegistry, tmp_path: Path, *, rank: int, world_size: int, name: str
) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = tmp_path / f"{name}-rank{rank}.log"
    argv = worker_argv(
        "train", "--dir", str(tmp_path / "ckpt"), "--init-file", str(tmp_path / f"{name}.init")
    )
    proc = procs.spawn(argv, log_path=log_path, env=worker_env(rank=rank, world_size=world_size))
    return proc, log_path


def wait_exit(
    proc: subprocess.Popen[bytes], log_path: Path, what: str, *, timeout: float = 60
) -> int:
    """Wait for ``proc`` to end; return its code, or fail with where it is stuck.

    On a timeout the worker's faulthandler (SIGUSR1) writes every thread's stack
    into its log, and the failure shows the log's tail.
    """
    try:
        wait_for(lambda: proc.poll() is not None, timeout=timeout, what=what)
    except TimeoutError as exc:
        dump_stacks({log_path: proc.pid})
        tail = log_path.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{exc}; its log ends:\n{tail}") from exc
    assert proc.returncode is not None
    return proc.returncode


def resume_step(procs: ProcessGroupRegistry, tmp_path: Path, *, total: int) -> int:
    """Run the job again to ``total`` steps; return the step it resumed at."""
    log_path = tmp_path / "resume.log"
    argv = worker_argv("train", "--dir", str(tmp_path / "ckpt"), "--total-steps", str(total))
    proc = procs.spawn(argv, log_path=log_path, env=worker_env(rank=0, world_size=1))
    code = wait_exit(proc, log_path, "the resumed run to finish")
    text = log_path.read_text(errors="replace")
    assert code == 0, text[-3000:]
    match = re.search(r"rank 0 resumed at step (\d+) fresh False", text)
    assert match, text[-3000:]
    assert f"rank 0 finished at step {total}" in text
    return int(match.group(1))


def test_sigterm_saves_the_current_step_and_exits_75(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    proc, log_path = start_rank(procs, tmp_path, rank=0, world_size=1, name="single")
    wait_for(lambda: len(completed_steps(log_path, 0)) >= 20, timeout=60, what="20 steps")
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, log_path, "the worker to stop after SIGTERM")
    text = log_path.read_text(errors="replace")
    assert code == ck.EXIT_PREEMPTED, text[-3000:]
    last = completed_steps(log_path, 0)[-1]
    assert f"stop requested: saving step {last}, then exiting with 75" in text
    store_steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name != ".fence.json")
    assert store_steps == [f"step-{last:010d}"]  # --every-steps unset: the stop made the only one
    assert resume_step(procs, tmp_path, total=last + 3) == last


@pytest.mark.slow  # 18 s under load: two ranks start torch, twice
def test_sigterm_to_one_rank_stops_both_ranks_at_the_same_step(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    ranks = [start_rank(procs, tmp_path, rank=r, world_size=2, name="pair") for r in range(2)]
    wait_for(
        lambda: all(len(completed_steps(log, r)) >= 20 for r, (_, log) in enumerate(ranks)),
        timeout=90,
        what="20 steps on both ranks",
    )
    ranks[1][0].send_signal(signal.SIGTERM)  # only rank 1 hears it; rank 0 writes
    codes = [wait_exit(p, log, f"rank {r} to stop") for r, (p, log) in enumerate(ranks)]
    logs = [log.read_text(errors="replace")[-3000:] for _, log in ranks]
    assert codes == [ck.EXIT_PREEMPTED] * 2, logs
    last = [completed_steps(log, r)[-1] for r, (_, log) in enumerate(ranks)]
    assert last[0] == last[1], last
    assert f"stop requested: saving step {last[0]}" in logs[0]
    assert resume_step(procs, tmp_path, total=last[0] + 2) == last[0]
