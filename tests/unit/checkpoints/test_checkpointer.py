"""The Checkpointer in one process: round trip, schedule, skip policy, stop, failures."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoints as ck
import checkpoints.saving as saving_module
from checkpoints.errors import CheckpointStateError


def _checkpoints(root: Path) -> list[str]:
    """The checkpoint directories under ``root`` (not the fence, nor temporary ones)."""
    return sorted(name for name in os.listdir(root) if name.startswith("step-"))


class Job:
    """A tiny model, optimizer, scheduler and grad scaler that train deterministically."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
        self.extras: dict[str, Any] = {}

    def step(self) -> torch.Tensor:
        loss = self.model(torch.randn(5, 4)).pow(2).mean()
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.detach()

    def checkpointer(self, directory: Path, **options: Any) -> ck.Checkpointer:
        options.setdefault("handle_sigterm", False)
        return ck.Checkpointer(
            directory,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            extra_state=lambda: {"note": "hi", "tensor": torch.arange(3)},
            load_extra_state=self.extras.update,
            **options,
        )


def test_an_empty_directory_means_a_fresh_start(tmp_path: Path) -> None:
    job = Job()
    with job.checkpointer(tmp_path) as ckpt:
        resume = ckpt.restore()
    assert resume == ck.Resume(step=0, fresh=True, path=None, saved_world_size=None, extra={})


@pytest.mark.parametrize("async_save", [True, False])
def test_restore_brings_back_every_part_of_the_state(tmp_path: Path, async_save: bool) -> None:
    job = Job()
    with job.checkpointer(tmp_path, async_save=async_save) as ckpt:
        ckpt.restore()
        for step in range(5):
            job.step()
            ckpt.maybe_save(step + 1)
        job.scaler.update(64.0)
        ckpt.save(5)
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    schedule = job.scheduler.state_dict()
    expected_next = job.step()  # what the uninterrupted job does next

    other = Job(seed=99)
    torch.manual_seed(12345)
    random.seed(12345)
    with other.checkpointer(tmp_path) as ckpt:
        resume = ckpt.restore()
    assert resume.step == 5 and not resume.fresh and resume.saved_world_size == 1
    assert resume.path == tmp_path / "step-0000000005"
    assert resume.extra["note"] == "hi" and other.extras["note"] == "hi"
    assert torch.equal(resume.extra["tensor"], torch.arange(3))
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
    assert other.scheduler.state_dict() == schedule
    assert other.scaler.get_scale() == 64.0
    # Same model, optimizer moments, schedule and RNG: the next step is the same step.
    torch.testing.assert_close(other.step(), expected_next, rtol=0, atol=0)
    torch.testing.assert_close(other.model.state_dict(), job.model.state_dict(), rtol=0, atol=0)


def test_saves_follow_every_steps_and_only_the_newest_k_remain(tmp_path: Path) -> None:
    job = Job()
    with job.checkpointer(tmp_path, every_steps=3, keep=2, async_save=False) as ckpt:
        ckpt.restore()
        started = [step + 1 for step in range(10) if (job.step(), ckpt.maybe_save(step + 1))[1]]
    assert started == [3, 6, 9]
    assert _checkpoints(tmp_path) == ["step-0000000006", "step-0000000009"]


def test_every_seconds_triggers_saves_by_time(tmp_path: Path) -> None:
    job = Job()
    with job.checkpointer(tmp_path, every_seconds=1e-9, async_save=False, keep=10) as ckpt:
        ckpt.restore()
        for step in range(3):
            job.step()
            assert ckpt.maybe_save(step + 1)
    assert len(_checkpoints(tmp_path)) == 3


def test_a_due_save_is_skipped_with_a_log_line_while_one_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()
    real_write = saving_module.write_replicated

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30), "the test never released the writer"
        return real_write(*args, **kwargs)

    monkeypatch.setattr(saving_module, "write_replicated", slow_write)
    job = Job()
    caplog.set_level(logging.INFO, logger="checkpoints")
    with job.checkpointer(tmp_path, every_steps=2) as ckpt:
        ckpt.restore()
        job.step()
        job.step()
        assert ckpt.maybe_save(2)  # starts, and blocks in the writer
        job.step()
        job.step()
        assert not ckpt.maybe_save(4)  # due, but the save of step 2 is still in flight
        assert "skipping the checkpoint of step 4" in caplog.text
        release.set()
    assert _checkpoints(tmp_path) == ["step-0000000002"]


def test_sigterm_saves_at_the_step_boundary_and_exits_75(tmp_path: Path) -> None:
    job = Job()
    ckpt = job.checkpointer(tmp_path, handle_sigterm=True, every_steps=1000)
    ckpt.restore()
    job.step()
    ckpt.maybe_save(1)
    os.kill(os.getpid(), signal.SIGTERM)  # handled: only sets a flag
    assert ckpt.stop_requested
    job.step()
    with pytest.raises(SystemExit) as info:
        ckpt.maybe_save(2)
    assert info.value.code == ck.EXIT_PREEMPTED == 75
    assert _checkpoints(tmp_path) == ["step-0000000002"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was removed


def test_a_failed_save_is_reported_and_leaves_older_checkpoints_intact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    progress_dir = tmp_path / "progress"
    reporter = ck.FileProgressReporter(progress_dir, rank=0, world_size=1, interval=0.0)
    job = Job()
    root = tmp_path / "ckpt"
    ckpt = job.checkpointer(root, progress=reporter)
    ckpt.restore()
    job.step()
    ckpt.save(1)
    ckpt._saver.writer.wait()
    # The checkpoint root stops being a directory: the next save cannot even start writing.
    shutil.move(root, tmp_path / "moved")
    root.write_text("not a directory")
    job.step()
    ckpt.save(2)  # asynchronous: the error shows in the log and the progress file
    with pytest.raises(ck.CheckpointWriteError, match="step 2"):
        ckpt.close()
    assert "failed" in caplog.text
    assert "step 2" in (progress_dir / "rank-0.json").read_text()
    survivor = ck.Checkpointer(tmp_path / "moved", model=Job().model, handle_sigterm=False)
    assert survivor.restore().step == 1


def test_saving_the_same_step_twice_writes_once(tmp_path: Path) -> None:
    job = Job()
    with job.checkpointer(tmp_path, every_steps=1) as ckpt:
        ckpt.restore()
        job.step()
        assert ckpt.maybe_save(1)
        ckpt.save(1)
    assert len(ckpt.saves) == 1


def test_options_out_of_range_are_refused_with_their_value(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"keep \(0\)"):
        ck.Checkpointer(tmp_path, model=model, keep=0)
    with pytest.raises(ValueError, match=r"every_steps \(0\)"):
        ck.Checkpointer(tmp_path, model=model, every_steps=0)


def test_extras_must_be_a_dict_of_checkpointable_values(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    ckpt = ck.Checkpointer(
        tmp_path, model=model, extra_state=lambda: {"bad": {1, 2}}, handle_sigterm=False
    )
    with pytest.raises(CheckpointStateError, match=r"\['extra'\]\['bad'\] is a set"):
        ckpt.save(1)
    ckpt.close()
