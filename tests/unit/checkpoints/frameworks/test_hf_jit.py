"""checkpoints.frameworks.hf_jit's pure parts: which step a failure saves, and the commit of a
Trainer checkpoint by several survivors at once (no transformers needed), plus the saver on a
real Trainer in one process."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints.frameworks.hf_checkpoint import IncompleteCheckpointError
from checkpoints.frameworks.hf_jit import (
    HFJustInTimeSave,
    Outcome,
    choose_step,
    commit_checkpoint,
    is_complete,
    newest_complete_step,
    save_model,
    sharded_reason,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)


def test_choose_step_takes_the_last_completed_step() -> None:
    assert choose_step(7, dirty=False, global_step=7) == (7, "")


def test_choose_step_refuses_before_the_first_step() -> None:
    step, why = choose_step(None, dirty=True, global_step=0)
    assert step is None and "no step completed" in why


def test_choose_step_refuses_once_an_optimizer_step_began() -> None:
    step, why = choose_step(7, dirty=True, global_step=7)
    assert step is None and "optimizer step had begun" in why


def test_choose_step_refuses_when_the_trainer_moved_past_the_recorded_step() -> None:
    step, why = choose_step(7, dirty=False, global_step=8)
    assert step is None and "step 8" in why


def test_sharded_state_is_named() -> None:
    class Args:
        fsdp = "full_shard"
        deepspeed = None

    class Plain:
        fsdp: Any = []
        deepspeed = None

    assert "FSDP" in (sharded_reason(Args()) or "")
    assert sharded_reason(Plain()) is None


def writers(tag: str) -> tuple[Any, Any]:
    def write_rng(path: Path) -> None:
        path.write_text(f"rng {tag}")

    def write_shared(directory: Path) -> None:
        (directory / "model.safetensors").write_text(f"model {tag}")
        (directory / "optimizer.pt").write_text(f"optimizer {tag}")
        (directory / "trainer_state.json").write_text(json.dumps({"by": tag}))

    return write_rng, write_shared


def commit(out: Path, step: int, tag: str, *, shared: bool = True) -> Outcome:
    write_rng, write_shared = writers(tag)
    return commit_checkpoint(out, step, rng_name=f"rng_state_{tag}.pth", write_rng=write_rng,
                             write_shared=write_shared if shared else None)


def test_the_first_survivor_writes_the_checkpoint_and_a_later_one_adds_its_rng_file(
    tmp_path: Path,
) -> None:
    assert commit(tmp_path, 5, "0") is Outcome.WRITTEN
    assert commit(tmp_path, 5, "1") is Outcome.JOINED
    final = tmp_path / "checkpoint-5"
    assert is_complete(final)
    assert json.loads((final / "trainer_state.json").read_text()) == {"by": "0"}  # not replaced
    assert sorted(p.name for p in final.iterdir() if p.name.startswith("rng")) == [
        "rng_state_0.pth", "rng_state_1.pth"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")] == []


def test_survivors_committing_at_once_leave_one_complete_checkpoint_with_every_rng_file(
    tmp_path: Path,
) -> None:
    outcomes: list[Outcome] = []
    threads = [threading.Thread(target=lambda t=str(r): outcomes.append(commit(tmp_path, 3, t)))
               for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == sorted([Outcome.WRITTEN] + [Outcome.JOINED] * 3)
    final = tmp_path / "checkpoint-3"
    assert is_complete(final)
    assert {f"rng_state_{r}.pth" for r in range(4)} <= {p.name for p in final.iterdir()}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")] == []


def test_a_complete_newer_checkpoint_is_never_overwritten_nor_shadowed(tmp_path: Path) -> None:
    assert commit(tmp_path, 9, "0") is Outcome.WRITTEN
    assert commit(tmp_path, 4, "1") is Outcome.NEWER
    assert not (tmp_path / "checkpoint-4").exists()
    assert newest_complete_step(tmp_path) == 9


def test_an_incomplete_checkpoint_of_the_step_is_completed_keeping_its_rng_files(
    tmp_path: Path,
) -> None:
    cut_short = tmp_path / "checkpoint-6"  # a Trainer save cut short: no trainer state
    cut_short.mkdir()
    (cut_short / "model.safetensors").write_text("half")
    (cut_short / "rng_state_2.pth").write_text("rng 2")
    assert not is_complete(cut_short)
    assert commit(tmp_path, 6, "0") is Outcome.WRITTEN
    assert is_complete(cut_short)
    assert (cut_short / "model.safetensors").read_text() == "model 0"
    assert (cut_short / "rng_state_2.pth").read_text() == "rng 2"
    assert (cut_short / "rng_state_0.pth").read_text() == "rng 0"


def test_a_rank_without_the_shared_files_parks_its_rng_file_until_they_come(
    tmp_path: Path,
) -> None:
    assert commit(tmp_path, 2, "1", shared=False) is Outcome.PARKED
    assert not (tmp_path / "checkpoint-2").exists()  # nothing under the final name yet
    assert commit(tmp_path, 2, "0") is Outcome.WRITTEN
    final = tmp_path / "checkpoint-2"
    assert (final / "rng_state_1.pth").read_text() == "rng 1"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")] == []


def test_a_failed_write_leaves_no_checkpoint_and_no_temporary_directory(tmp_path: Path) -> None:
    def broken(directory: Path) -> None:
        (directory / "model.safetensors").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        commit_checkpoint(tmp_path, 1, rng_name="rng_state_0.pth",
                          write_rng=lambda p: p.write_text("rng"), write_shared=broken)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".tidal")] == []


def test_shared_files_without_the_weights_are_never_put_in_place(tmp_path: Path) -> None:
    def no_weights(directory: Path) -> None:  # what save_pretrained did on a rank other than 0
        (directory / "optimizer.pt").write_text("optimizer")
        (directory / "trainer_state.json").write_text("{}")

    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint-8 came out incomplete.*"
                       r"written were optimizer.pt, rng_state_1.pth, trainer_state.json"):
        commit_checkpoint(tmp_path, 8, rng_name="rng_state_1.pth",
                          write_rng=lambda p: p.write_text("rng"), write_shared=no_weights)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".tidal")] == []
    assert newest_complete_step(tmp_path) is None


# ----------------------------------------------------- the saver on a real Trainer


def test_the_model_is_saved_by_a_survivor_that_is_not_rank_0(tmp_path: Path) -> None:
    """transformers 5.x's save_pretrained writes only on torch.distributed's rank 0; a survivor
    of another rank must still write the model (rank 0 may be the one that died)."""
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        save_model(model, tmp_path)
    finally:
        dist.destroy_process_group()
    assert {"model.safetensors", "config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert "should_save_on_this_rank" not in vars(model)  # the instance is left as it was
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())


def test_the_saver_writes_the_last_completed_step_in_the_trainers_own_layout(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    from checkpoints.frameworks.hf import TidalCallback

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                     n_positions=16)
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    out = tmp_path / "out"
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_steps=1000,
        use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1,
    )

    class FailAtStep3(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                raise RuntimeError("Connection closed by peer (a gloo collective failed)")

    callback = TidalCallback(handle_sigterm=False)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=data, callbacks=[FailAtStep3(), callback])
    try:
        with pytest.raises(RuntimeError) as failed:
            trainer.train()
        expected = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        assert callback.save_after_failure(ValueError("not a collective")) is None
        assert callback.save_after_failure(failed.value) == out / "checkpoint-3"
        assert callback.save_after_failure(failed.value) == out / "checkpoint-3"  # once
    finally:
        callback.jit.disarm()
    names = {p.name for p in (out / "checkpoint-3").iterdir()}
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json", "training_args.bin"} <= names
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())[
        "global_step"] == 3

    resumed = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=data)
    resumed._load_from_checkpoint(str(out / "checkpoint-3"))
    torch.testing.assert_close(
        {k: v for k, v in resumed.model.state_dict().items()}, expected)


def test_the_callback_arms_no_saver_when_switched_off_or_sharded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    from checkpoints.frameworks.hf import TidalCallback

    class Args:
        output_dir = str(tmp_path)
        fsdp: Any = []
        deepspeed = None

    model = torch.nn.Linear(2, 2)
    kwargs = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    on = TidalCallback(handle_sigterm=False)
    on._arm_jit(Args(), None, kwargs)
    try:
        assert on.jit is not None
    finally:
        on._disarm_jit()

    off = TidalCallback(handle_sigterm=False, jit_save=False)
    off._arm_jit(Args(), None, kwargs)
    assert off.jit is None
    monkeypatch.setenv("TIDAL_JIT_SAVE", "0")
    by_env = TidalCallback(handle_sigterm=False)
    by_env._arm_jit(Args(), None, kwargs)
    assert by_env.jit is None
    monkeypatch.delenv("TIDAL_JIT_SAVE")

    sharded = Args()
    sharded.fsdp = "full_shard"
    callback = TidalCallback(handle_sigterm=False)
    with caplog.at_level("WARNING"):
        callback._arm_jit(sharded, None, kwargs)
    assert callback.jit is None
    assert "no just-in-time save" in caplog.text and "FSDP" in caplog.text


class FakeState:
    """The part of transformers' TrainerState the saver uses."""

    def __init__(self) -> None:
        self.global_step = 0

    def save_to_json(self, path: str) -> None:
        Path(path).write_text(json.dumps({"global_step": self.global_step}))


class FakeArgs:
    """The part of TrainingArguments the saver uses (module level: training_args.bin pickles it)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.world_size = 1


def make_saver(tmp_path: Path, *, progress_dir: Path | None = None) -> tuple[Any, ...]:
    pytest.importorskip("safetensors")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = FakeState()
    saver = HFJustInTimeSave(args=FakeArgs(str(tmp_path / "out")), state=state, model=model,
                             optimizer=optimizer, progress_dir=progress_dir, exit_at_once=False)
    return saver, model, optimizer, state


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_saver_refuses_state_an_optimizer_step_has_begun_to_change(tmp_path: Path) -> None:
    saver, model, optimizer, state = make_saver(tmp_path)
    try:
        step(model, optimizer)
        state.global_step = 1
        saver.boundary(1)
        step(model, optimizer)  # the next step began (and here ended) before the failure
        assert saver.save("a collective failed") is None
        assert not (tmp_path / "out" / "checkpoint-1").exists()
    finally:
        saver.disarm()


def test_the_runners_notice_saves_the_last_completed_step_from_a_thread(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    progress.mkdir()
    saver, model, optimizer, state = make_saver(tmp_path, progress_dir=progress)
    try:
        step(model, optimizer)
        state.global_step = 1
        saver.boundary(1)
        saver.arm()
        assert json.loads((progress / "saving-rank-0.json").read_text())["state"] == "armed"
        (progress / "peer-lost").write_text("{}")
        wait_for(lambda: json.loads((progress / "saving-rank-0.json").read_text())["state"]
                 == "done", timeout=20, what="the saver to report its save done")
        final = tmp_path / "out" / "checkpoint-1"
        assert saver.path == final and saver.outcome is Outcome.WRITTEN
        assert {"model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json",
                "training_args.bin"} <= {p.name for p in final.iterdir()}
    finally:
        saver.disarm()
