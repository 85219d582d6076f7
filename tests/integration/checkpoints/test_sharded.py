"""Resharding: an FSDP2 checkpoint saved at world size 2 over gloo loads at 1 and at 3.

Real processes (FSDP2 on CPU, gloo) train three steps at world size 2 and save
through torch.distributed.checkpoint; jobs at world size 1 and 3 restore it.
The full (unsharded) model and Adam state each job ends up with must equal
what the saving job had, exactly, and the scheduler must be restored too.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.checkpoints.ckpt_worker import worker_argv, worker_env
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for


def run_job(
    procs: ProcessGroupRegistry, tmp_path: Path, *, name: str, world_size: int, save: bool
) -> dict[str, Any]:
    """Run the sharded worker at ``world_size``; return rank 0's dump of the full state."""
    dump = tmp_path / f"{name}.pt"
    args = ["--dir", str(tmp_path / "ckpt"), "--init-file", str(tmp_path / f"{name}.init")]
    args += ["--dump", str(dump), "--width", "30"] + (["--save"] if save else [])
    running: list[tuple[subprocess.Popen[bytes], Path]] = []
    for rank in range(world_size):
        log_path = tmp_path / f"{name}-rank{rank}.log"
        env = worker_env(rank=rank, world_size=world_size)
        proc = procs.spawn(worker_argv("sharded", *args), log_path=log_path, env=env)
        running.append((proc, log_path))
    for rank, (proc, log_path) in enumerate(running):
        wait_for(lambda p=proc: p.poll() is not None, timeout=120, what=f"{name} rank {rank}")
        assert proc.returncode == 0, log_path.read_text(errors="replace")[-4000:]
    state: dict[str, Any] = torch.load(dump, weights_only=True)
    return state


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoint_saved_at_world_size_2_loads_at_1_and_3(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    saved = run_job(procs, tmp_path, name="save-w2", world_size=2, save=True)
    assert saved["resumed_step"] == 0
    assert saved["optimizer"], "Adam state is empty: nothing was trained"
    manifest = (tmp_path / "ckpt" / "step-0000000003" / "manifest.json").read_text()
    assert '"kind": "sharded"' in manifest and '"world_size": 2' in manifest
    for world_size in (1, 3):
        name = f"load-w{world_size}"
        loaded = run_job(procs, tmp_path, name=name, world_size=world_size, save=False)
        assert loaded["resumed_step"] == 3
        assert loaded["scheduler"] == 3
        torch.testing.assert_close(loaded["model"], saved["model"], rtol=0, atol=0)
        torch.testing.assert_close(loaded["optimizer"], saved["optimizer"], rtol=0, atol=0)
