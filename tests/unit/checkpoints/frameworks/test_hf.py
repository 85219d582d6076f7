"""checkpoints.frameworks.hf.TidalCallback in one process, with a real transformers Trainer
(that importing it does not import transformers: tests/integration/test_imports.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints.progress import FileProgressReporter

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def make_trainer(out: Path, callbacks: list[Any], *, max_steps: int) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
        logging_steps=1, save_steps=1000, use_cpu=True, report_to=[], disable_tqdm=True,
    )
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                train_dataset=data, callbacks=callbacks)


def test_the_callback_reports_step_loss_total_and_paces(tmp_path: Path) -> None:
    from checkpoints.frameworks.hf import TidalCallback

    reporter = FileProgressReporter(tmp_path / "progress", rank=0, world_size=1, interval=0.0)
    callback = TidalCallback(progress=reporter, handle_sigterm=False)
    assert isinstance(callback, transformers.TrainerCallback)
    make_trainer(tmp_path / "out", [callback], max_steps=3).train()
    report = json.loads(reporter.path.read_text())
    assert report["step"] == 3 and report["total_steps"] == 3
    assert isinstance(report["loss"], float)
    assert [s for s, _ in report["paces"]] == [1, 2, 3]
    assert report["samples_per_second"] is not None


def test_sigterm_stops_training_at_the_next_step_with_a_trainer_checkpoint(
    tmp_path: Path,
) -> None:
    from checkpoints.frameworks.hf import TidalCallback

    class SigtermAfterStep2(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    reporter = FileProgressReporter(tmp_path / "progress", rank=0, world_size=1, interval=0.0)
    callback = TidalCallback(progress=reporter, exit_on_stop=False)
    previous = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(tmp_path / "out", [SigtermAfterStep2(), callback], max_steps=10)
    trainer.train()
    assert signal.getsignal(signal.SIGTERM) == previous  # put back at the end
    # One process: no exchange to wait for, so the step that saw the flag stops.
    assert callback.stop_requested and callback.stop_step == 2
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").exists()
    report = json.loads(reporter.path.read_text())
    assert report["stop_requested"] is True and report["last_checkpoint_step"] == 2


def test_sigterm_exits_with_75_after_the_checkpoint_by_default(tmp_path: Path) -> None:
    from checkpoints.frameworks.hf import TidalCallback

    class SigtermAfterStep1(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = make_trainer(tmp_path / "out", [SigtermAfterStep1(), TidalCallback()], max_steps=5)
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == 75
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").exists()
