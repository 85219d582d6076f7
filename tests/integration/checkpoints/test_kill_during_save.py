"""SIGKILL while saving, over and over: a loadable checkpoint always remains.

A zygote process forks savers one at a time; each restores from the shared
directory and then saves after every step (alternately asynchronously and
synchronously), so it spends its life inside the save path. The test kills
each saver with SIGKILL at a random moment (the random delay is the fault
injection, not synchronisation), then checks: every directory under a final
``step-*`` name verifies (nothing partial was published), restore succeeds,
and it never goes backwards.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

import checkpoints as ck
from checkpoints.storage import CheckpointStore
from tests.integration.checkpoints.ckpt_worker import make_mlp, worker_argv, worker_env
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

KILLS = 24
WIDTH = 20_000  # ~360k float64 parameters + Adam moments: ~9 MB per checkpoint


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_at_random_points_of_a_save_always_leaves_a_loadable_checkpoint(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    root, control = tmp_path / "ckpt", tmp_path / "control"
    control.mkdir()
    log_path = tmp_path / "zygote.log"
    argv = worker_argv(
        "zygote",
        "--dir",
        str(root),
        "--control",
        str(control),
        "--children",
        str(KILLS),
        "--width",
        str(WIDTH),
    )
    zygote = procs.spawn(argv, log_path=log_path, env=worker_env(rank=0, world_size=1))
    rng = random.Random(1234)
    best, bad_restores, steps_seen = -1, [], []
    for index in range(KILLS):
        (control / f"go-{index}").touch()
        pid = wait_for(
            lambda i=index: saving_pid(log_path, i), timeout=60, what=f"saver {index} to start"
        )
        time.sleep(rng.uniform(0.0, 0.4))  # fault injection: a random point in the save loop
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda p=pid: f"child {p} ended with status {signal.SIGKILL}" in log_path.read_text(),
            timeout=30,
            what=f"the zygote to reap saver {pid}",
        )
        assert zygote.poll() is None, log_path.read_text()[-3000:]
        step = check_directory(root)
        steps_seen.append(step)
        if best > 0 and step < best:  # went backwards, or fresh after a save had completed
            bad_restores.append((index, best, step))
        best = max(best, step)
    assert bad_restores == [], (bad_restores, steps_seen)
    assert best > 0, f"no save ever completed: {steps_seen}\n{log_path.read_text()[-3000:]}"
    assert len(set(steps_seen)) > KILLS // 3, steps_seen  # the kills landed at many points


def saving_pid(log_path: Path, index: int) -> int | None:
    pids = re.findall(r"^child (\d+) restored step -?\d+, saving$", log_path.read_text(), re.M)
    return int(pids[index]) if len(pids) > index else None


def check_directory(root: Path) -> int:
    """Every published checkpoint verifies; restore works. Returns the restored step (-1: fresh)."""
    if not root.exists():
        return -1
    store = CheckpointStore(root)
    for step in store.steps():
        store.verify(store.path_of(step))  # raises, naming the file, if anything is partial
    model = make_mlp(WIDTH)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = ck.Checkpointer(root, model=model, optimizer=optimizer, handle_sigterm=False)
    resume = ckpt.restore()
    ckpt.close()
    return -1 if resume.fresh else resume.step
