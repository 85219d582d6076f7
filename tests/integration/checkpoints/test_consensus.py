"""The step flags' exchange fails within the training group's timeout, not its own.

The checkpointer agrees on its flags (stop, a save due, a live resize) in a
private gloo group whose timeout is 10 minutes, for restores and saves. A
reduction whose peer never takes part must fail within the timeout the
training script gave ``init_process_group`` instead: a peer that died or hung
would otherwise hold a survivor, or a hung rank that wakes, for 10 minutes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.checkpoints.ckpt_worker import worker_argv, worker_env
from tests.integration.checkpoints.test_sigterm import wait_exit
from tests.support.processes import ProcessGroupRegistry

pytestmark = pytest.mark.timeout(180)


def test_a_peer_that_never_exchanges_fails_the_drain_within_the_training_timeout(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    ranks = []
    for rank in range(2):
        log_path = tmp_path / f"rank{rank}.log"
        argv = worker_argv(
            "consensus", "--dir", str(tmp_path / "ckpt"), "--init-file", str(tmp_path / "c.init"),
            "--control", str(tmp_path), "--timeout", "3",
        )
        ranks.append((procs.spawn(argv, log_path=log_path, env=worker_env(rank=rank, world_size=2)),
                      log_path))
    try:
        # Within wait_exit's 60 s: the flags group's own 10 minutes would time it out.
        code = wait_exit(*ranks[0], "rank 0's exchange to fail")
    finally:
        (tmp_path / "go").touch()  # rank 1 leaves
    text = ranks[0][1].read_text(errors="replace")
    assert code == 3, text[-3000:]
    failed = re.search(r"drain failed after ([\d.]+) s \(collective failure (\w+)\): (.*)", text)
    assert failed, text[-3000:]
    assert failed.group(2) == "True", failed.group(0)  # the excepthook's JIT save would run
    assert "3000ms" in failed.group(3), failed.group(0)  # gloo's words: the training timeout
    assert wait_exit(*ranks[1], "rank 1 to leave") == 0


def test_destroying_the_consensus_joins_its_groups_threads_at_once(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    """The stop path destroys the flags' group before SystemExit: its threads must be gone
    then, not at interpreter exit, where a worker thread releasing an operation aborted a
    stopped rank (-6 instead of 75; StepConsensus)."""
    ranks = []
    for rank in range(2):
        log_path = tmp_path / f"rank{rank}.log"
        argv = worker_argv(
            "destroy", "--dir", str(tmp_path / "ckpt"), "--init-file", str(tmp_path / "d.init"),
        )
        ranks.append((procs.spawn(argv, log_path=log_path, env=worker_env(rank=rank, world_size=2)),
                      log_path))
    for rank, (proc, log_path) in enumerate(ranks):
        code = wait_exit(proc, log_path, f"rank {rank} to finish")
        text = log_path.read_text(errors="replace")
        assert code == 0, text[-3000:]
        counted = re.search(r"threads before (\d+) after (\d+)", text)
        assert counted, text[-3000:]
        before, after = int(counted.group(1)), int(counted.group(2))
        # A gloo group runs two worker threads and its transport's loop thread.
        assert after <= before - 2, counted.group(0)
