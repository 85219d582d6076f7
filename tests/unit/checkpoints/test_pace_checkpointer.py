"""The Checkpointer times each step with a PaceMeter and its progress file carries the paces."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from checkpoints import Checkpointer
from checkpoints.progress import FileProgressReporter


def test_each_completed_step_has_a_pace_in_the_progress_file(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reporter = FileProgressReporter(tmp_path / "progress", rank=0, world_size=1, interval=0.0)
    ckpt = Checkpointer(tmp_path / "ck", model=model, optimizer=opt, progress=reporter,
                        handle_sigterm=False, jit_save=False)
    for step in range(1, 4):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ckpt.maybe_save(step)
    ckpt.close()
    report = json.loads(reporter.path.read_text())
    assert [s for s, _ in report["paces"]] == [1, 2, 3]
    assert all(pace >= 0 for _, pace in report["paces"])


def test_a_step_without_a_backward_has_no_pace(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    reporter = FileProgressReporter(tmp_path / "progress", rank=0, world_size=1, interval=0.0)
    ckpt = Checkpointer(tmp_path / "ck", model=model, progress=reporter,
                        handle_sigterm=False, jit_save=False)
    with torch.no_grad():
        model(torch.ones(2, 4))
    ckpt.maybe_save(1)
    ckpt.close()
    assert json.loads(reporter.path.read_text())["paces"] == []
