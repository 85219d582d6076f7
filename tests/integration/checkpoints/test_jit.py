"""Just-in-time saves with real ranks: a killed peer, a hung peer, and the fence.

Three ranks train with DDP over gloo, each as if alone on its node (local rank
0, so each writes its own candidate), checkpointing only every 50 steps. A
peer dies or hangs well past the last periodic checkpoint; the survivors must
keep the last completed step, and a hung peer that wakes up later must not
become the newest state.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from checkpoints.protocol.jit import read_reports, write_notice
from checkpoints.storage import CheckpointStore
from tests.integration.checkpoints.ckpt_worker import worker_argv, worker_env
from tests.integration.checkpoints.test_sigterm import completed_steps, resume_step, wait_exit
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
EVERY = 20
COLLECTIVE_TIMEOUT_S = 60  # the workers' init_process_group timeout (ckpt_worker's default)


def start_trio(
    procs: ProcessGroupRegistry, tmp_path: Path, *, pace: float
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    ranks = []
    for rank in range(3):
        log_path = tmp_path / f"rank{rank}.log"
        env = worker_env(rank=rank, world_size=3)
        env["LOCAL_RANK"] = "0"  # one rank per "node": every rank writes its candidate
        progress = tmp_path / f"progress-{rank}"
        progress.mkdir()
        env["TIDAL_PROGRESS_DIR"] = str(progress)
        argv = worker_argv(
            "train", "--dir", str(tmp_path / "ckpt"), "--init-file", str(tmp_path / "trio.init"),
            "--every-steps", str(EVERY), "--pace", str(pace),
        )
        ranks.append((procs.spawn(argv, log_path=log_path, env=env), log_path))
    return ranks


def last_completed(log_path: Path, rank: int) -> int:
    steps = completed_steps(log_path, rank)
    return steps[-1] if steps else 0


def jit_steps(log_path: Path) -> list[int]:
    text = log_path.read_text(errors="replace")
    return [int(s) for s in re.findall(r"just-in-time save of step (\d+) committed", text)]


def test_survivors_of_a_killed_peer_resume_from_the_last_completed_step(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    ranks = start_trio(procs, tmp_path, pace=0.01)
    wait_for(lambda: last_completed(ranks[0][1], 0) >= EVERY + 7, timeout=120,
             what=f"{EVERY + 7} steps")
    procs.signal_group(ranks[2][0], signal.SIGKILL)  # a few steps after the periodic save
    for rank in (0, 1):  # at the collective timeout at the latest (the hung-peer test says why)
        proc, log_path = ranks[rank]
        assert wait_exit(proc, log_path, f"rank {rank} to fail",
                         timeout=COLLECTIVE_TIMEOUT_S + 45) != 0
    done = max(last_completed(ranks[r][1], r) for r in (0, 1))
    saved = [s for r in (0, 1) for s in jit_steps(ranks[r][1])]
    assert saved, ranks[0][1].read_text(errors="replace")[-3000:]
    assert all(done - 1 <= s <= done for s in saved), (saved, done)
    resumed = resume_step(procs, tmp_path, total=done + 3)
    assert done - 1 <= resumed <= done and resumed > EVERY
    # The restore promoted one candidate and removed the rest.
    assert not [c for c in CheckpointStore(tmp_path / "ckpt").candidates() if c.jit]


def test_a_hung_peer_is_saved_around_by_the_notice_and_fenced_out_when_it_wakes(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    ranks = start_trio(procs, tmp_path, pace=0.01)
    wait_for(lambda: last_completed(ranks[0][1], 0) >= EVERY + 7, timeout=120,
             what=f"{EVERY + 7} steps")
    hung = ranks[2][0]
    procs.signal_group(hung, signal.SIGSTOP)  # partitioned: no reset, the others block
    for rank in (0, 1):  # what each survivor's runner does when the peer's lease expires
        write_notice(tmp_path / f"progress-{rank}", "peer 2 lost")

    def saved(rank: int) -> bool:
        report = read_reports(tmp_path / f"progress-{rank}").get(rank)
        return report is not None and report.state == "done"

    wait_for(lambda: saved(0) and saved(1), timeout=60, what="the survivors' saves")
    steps = {read_reports(tmp_path / f"progress-{r}")[r].step for r in (0, 1)}
    for rank in (0, 1):
        procs.signal_group(ranks[rank][0], signal.SIGKILL)  # the runner stops them
    # The survivors restart and resume (epoch + 1): the fence now stands at that step.
    resumed = resume_step(procs, tmp_path, total=max(steps))
    assert resumed == max(steps) > EVERY
    store = CheckpointStore(tmp_path / "ckpt")
    fence = store.read_fence()
    assert fence.step == resumed
    # The hung peer wakes: its collective fails on the dead sockets, and its
    # excepthook tries to save what it holds, under the old epoch. Now and then
    # gloo leaves a send posted before the stop waiting for its whole timeout
    # although both peers' connections are closed: the worker's 60 s, counted
    # from before the stop, for DDP's all-reduce and the checkpointer's step
    # flags alike (checkpoints.signals.StepConsensus; it was their 10 minutes).
    procs.signal_group(hung, signal.SIGCONT)
    wait_exit(hung, ranks[2][1], "the woken rank to fail", timeout=COLLECTIVE_TIMEOUT_S + 45)
    woke = ranks[2][1].read_text(errors="replace")
    attempted = re.search(r"just-in-time save of step (\d+):", woke)
    assert attempted, woke[-3000:]
    if int(attempted.group(1)) > fence.step:
        assert "fenced out" in woke, woke[-3000:]
    # Whatever it did, the next restore resumes from the survivors' lineage.
    assert resume_step(procs, tmp_path, total=resumed) == resumed
