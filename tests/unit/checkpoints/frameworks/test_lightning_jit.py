"""checkpoints.frameworks.lightning_jit's pure parts (the commit of last.ckpt by several
survivors, which strategies are replicated), and the saver on a real Lightning Trainer in one
process: a failed collective leaves the last completed step, and fit(ckpt_path="last") resumes
it at that step."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints.frameworks.lightning_jit import Outcome, commit_last, saved_step, sharded_reason

pytestmark = pytest.mark.timeout(60)


def writer(step: int, tag: str) -> Any:
    def write(path: Path) -> None:
        torch.save({"global_step": step, "by": tag}, path)

    return write


def test_the_first_survivor_writes_last_ckpt_and_a_later_one_keeps_it(tmp_path: Path) -> None:
    assert commit_last(tmp_path, 4, writer(4, "0")) is Outcome.WRITTEN
    assert commit_last(tmp_path, 4, writer(4, "1")) is Outcome.SAME
    assert torch.load(tmp_path / "last.ckpt")["by"] == "0"
    assert saved_step(tmp_path / "last.ckpt") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tidal-jit.lock", "last.ckpt"]


def test_survivors_committing_at_once_leave_one_last_ckpt_of_the_step(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    threads = [threading.Thread(target=lambda t=str(r): outcomes.append(
        commit_last(tmp_path, 3, writer(3, t)))) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == sorted([Outcome.WRITTEN] + [Outcome.SAME] * 3)
    assert saved_step(tmp_path / "last.ckpt") == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_newer_last_ckpt_is_never_overwritten_and_an_older_one_is(tmp_path: Path) -> None:
    assert commit_last(tmp_path, 9, writer(9, "old run")) is Outcome.WRITTEN
    assert commit_last(tmp_path, 4, writer(4, "late")) is Outcome.NEWER
    assert saved_step(tmp_path / "last.ckpt") == 9
    assert commit_last(tmp_path, 12, writer(12, "new")) is Outcome.WRITTEN
    assert saved_step(tmp_path / "last.ckpt") == 12


def test_an_unreadable_last_ckpt_is_replaced_and_a_failed_write_leaves_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "last.ckpt").write_bytes(b"cut short")
    assert saved_step(tmp_path / "last.ckpt") is None
    assert commit_last(tmp_path, 2, writer(2, "0")) is Outcome.WRITTEN

    def broken(path: Path) -> None:
        path.write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        commit_last(tmp_path, 5, broken)
    assert saved_step(tmp_path / "last.ckpt") == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_only_replicated_strategies_and_optimizers_get_a_save() -> None:
    class DDPStrategy:
        pass

    class FSDPStrategy:
        pass

    class ZeroRedundancyOptimizer:
        def consolidate_state_dict(self) -> None:
            pass

    assert sharded_reason(DDPStrategy(), [torch.optim.SGD([torch.zeros(1)], lr=0.1)]) is None
    assert "FSDPStrategy" in (sharded_reason(FSDPStrategy()) or "")
    assert "ZeroRedundancyOptimizer" in (
        sharded_reason(DDPStrategy(), [ZeroRedundancyOptimizer()]) or "")


# ----------------------------------------------------- the saver on a real Trainer

FAIL_AT = 3  # the step whose training_step fails: steps 1-3 are complete


def fit(root: Path, *, fail: bool, max_steps: int = 6) -> tuple[Any, Any, Any]:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from checkpoints.frameworks.lightning import TidalCallback

    seen: dict[str, int] = {}

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)

        def on_train_start(self) -> None:
            seen["start_step"] = self.trainer.global_step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if fail and self.trainer.global_step == FAIL_AT:
                raise RuntimeError("Connection closed by peer (a gloo collective failed)")
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    callback = TidalCallback(handle_sigterm=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[callback, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1000)],
    )
    model = Tiny()
    if fail:
        with pytest.raises(RuntimeError, match="Connection closed"):
            trainer.fit(model, loader, ckpt_path="last")
    else:
        trainer.fit(model, loader, ckpt_path="last")
    return callback, model, seen


def test_a_failed_collective_saves_the_last_completed_step_and_fit_last_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lightning")
    monkeypatch.delenv("TIDAL_PROGRESS_DIR", raising=False)
    callback, model, _ = fit(tmp_path, fail=True)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    last = tmp_path / "ckpt" / "last.ckpt"
    assert callback.jit is not None and callback.jit.path == last
    callback.jit.disarm()  # the excepthook is not needed: pytest caught the exception
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == FAIL_AT
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == FAIL_AT
    torch.testing.assert_close(checkpoint["state_dict"], expected)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert progress["completed"] == progress["ready"] - 1 == FAIL_AT - 1  # as at its step's end

    _, _, seen = fit(tmp_path, fail=False)
    assert seen["start_step"] == FAIL_AT
