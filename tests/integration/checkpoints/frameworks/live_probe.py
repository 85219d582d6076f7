"""Probe (not a test): can a callback re-form the process group and re-wrap DDP inside
Lightning's ``fit()`` or the Hugging Face Trainer's ``train()``? (issue #26)

``.venv/bin/python -m tests.integration.checkpoints.frameworks.live_probe lightning``
(or ``hf``, or ``hf-state``) runs three ranks of a tiny job over gloo on CPU (a node
per rank, the torchrun environment). After step 3, rank 2 leaves (exits 0) and ranks
0 and 1, from a callback at that step boundary, do what the live path would do:
destroy the process group, form a new one of world size 2 on a new port, and re-wrap
the model in DDP on it (Lightning: ``strategy.model = strategy._setup_model(...)``;
the HF Trainer: ``trainer.model_wrapped = DistributedDataParallel(trainer.model)``;
``hf-state`` also sets accelerate's ``PartialState`` to 2 processes). Then they train
on. Each rank records the samples of every batch it trains and what happened; the
probe prints it, and for Lightning how many distinct samples each epoch trained.

What it showed (docs/frameworks.md, "The live path: where it does not hold"): with
Lightning 2.6 the re-formed group and the re-wrapped DDP train on (the strategy
reads ``self.model`` at each step), but the ``DistributedSampler`` keeps
``num_replicas=3``: ranks 0 and 1 train on their thirds and the leaver's third of
every epoch (64 of 96 samples) is never seen, this epoch and the next. With the
HF Trainer the next step fails: in accelerate's ``gather`` (its state still says 3
processes), or, with that state patched, in ``backward`` through the old DDP
wrapper the loop holds in a local variable (its reducer still on the group of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from tests.integration.checkpoints.frameworks.ranks import free_port, run_ranks
from tests.support.processes import ProcessGroupRegistry

SHRINK_AT = 3  # the step after which rank 2 leaves


def _worker(kind: str, out: Path) -> None:  # one probe, read top to bottom
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    log_file = open(out / f"rank{rank}.jsonl", "w", encoding="utf-8")  # noqa: SIM115

    def log(**fields: Any) -> None:
        log_file.write(json.dumps(fields) + "\n")
        log_file.flush()

    def leave() -> None:
        log(event="left")
        log_file.close()
        os._exit(0)

    def reform() -> None:
        dist.destroy_process_group()
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{os.environ['PROBE_PORT2']}")
        log(event="reformed", world_size=dist.get_world_size(), rank=dist.get_rank())

    class Ids(torch.utils.data.Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return 96

        def __getitem__(self, i: int) -> dict[str, Any]:
            token = torch.tensor([i % 16] * 4)
            return {"x": torch.full((4,), float(i)), "input_ids": token,
                    "labels": token.clone(), "id": i}

    def run(train: Any) -> None:
        try:
            train()
            log(event="finished")
        except Exception as exc:  # the finding: where the next step fails
            frames = traceback.extract_tb(exc.__traceback__)[-6:]
            log(event="failed", error=f"{type(exc).__name__}: {exc}"[:400],
                where=[f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                       for f in frames])

    if kind == "lightning":
        import lightning.pytorch as pl
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        from lightning.pytorch.plugins.environments import LightningEnvironment

        class Module(pl.LightningModule):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)

            def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
                log(step=self.trainer.global_step, ids=batch["id"].tolist(),
                    world_size=dist.get_world_size())
                loss: torch.Tensor = self.lin(batch["x"]).pow(2).mean()
                return loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=1e-4)

        class Shrink(pl.Callback):  # type: ignore[misc]
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step != SHRINK_AT or dist.get_world_size() != 3:
                    return
                if rank == 2:
                    leave()
                reform()
                strategy = trainer.strategy
                strategy.cluster_environment.set_world_size(2)
                strategy.cluster_environment.set_global_rank(rank)
                strategy.num_nodes = 2
                rank_zero_only.rank = rank
                strategy.model = strategy._setup_model(strategy.model.module)
                log(event="rewrapped",
                    sampler_replicas=trainer.train_dataloader.sampler.num_replicas)

        os.environ["NODE_RANK"] = str(rank)
        trainer = pl.Trainer(
            strategy="ddp", accelerator="cpu", devices=1, num_nodes=3, max_epochs=2,
            plugins=[LightningEnvironment()], callbacks=[Shrink()], logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, default_root_dir=str(out))
        loader = torch.utils.data.DataLoader(Ids(), batch_size=4, shuffle=False)
        run(lambda: trainer.fit(Module(), loader))
    else:
        from torch.nn.parallel import DistributedDataParallel
        from transformers import (
            GPT2Config,
            GPT2LMHeadModel,
            Trainer,
            TrainerCallback,
            TrainingArguments,
        )

        class HFShrink(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step != SHRINK_AT or dist.get_world_size() != 3:
                    return
                if rank == 2:
                    leave()
                reform()
                hf.model_wrapped = DistributedDataParallel(hf.model)
                if kind == "hf-state":
                    from accelerate.state import PartialState

                    PartialState._shared_state["num_processes"] = 2
                    PartialState._shared_state["process_index"] = rank
                log(event="rewrapped", args_world_size=args.world_size)

        def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            log(ids=[r["id"] for r in rows], world_size=dist.get_world_size())
            return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
                    "labels": torch.stack([r["labels"] for r in rows])}

        config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16, n_positions=8)
        arguments = TrainingArguments(
            output_dir=str(out), max_steps=12, per_device_train_batch_size=4, use_cpu=True,
            report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
            ddp_timeout=30)
        hf = Trainer(model=GPT2LMHeadModel(config), args=arguments, train_dataset=Ids(),
                     data_collator=collate, callbacks=[HFShrink()])
        run(hf.train)
    log_file.close()
    os._exit(0)  # the group of 2 is not torn down: a rank may already be gone


def _summary(kind: str, out: Path) -> str:
    lines = []
    epochs: dict[int, set[int]] = {}
    for rank in range(3):
        path = out / f"rank{rank}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
            else []
        steps = [r for r in records if "ids" in r]
        lines.append(f"rank {rank}: {len(steps)} batches; "
                     + "; ".join(json.dumps(r) for r in records if "event" in r))
        for r in steps:
            if kind == "lightning" and rank < 2 and r["step"] >= SHRINK_AT:
                epochs.setdefault(r["step"] // 8, set()).update(r["ids"])  # 8 batches an epoch
    if epochs:
        lines.append("distinct samples trained after the shrink, by epoch (of 96): "
                     + ", ".join(f"epoch {e}: {len(ids)}" for e, ids in sorted(epochs.items())))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["lightning", "hf", "hf-state"])
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        _worker(opts.kind, Path(opts.worker))
        return
    out = Path(tempfile.mkdtemp(prefix=f"live-probe-{opts.kind}-"))
    procs = ProcessGroupRegistry()
    try:
        exits = run_ranks(
            procs, Path(__file__), [opts.kind, "--worker", str(out)], world_size=3, logs=out,
            name=opts.kind, extra_env={"PROBE_PORT2": str(free_port())}, timeout=120)
    finally:
        procs.stop_all()
    print(f"exit codes {[code for code, _ in exits]}; logs in {out}")
    print(_summary(opts.kind, out))
    sys.exit(0)


if __name__ == "__main__":
    main()
