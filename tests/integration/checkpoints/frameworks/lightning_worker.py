"""One rank of a tiny Lightning job with tidal's plugin and callback (run by test_lightning.py).

``Trainer(strategy="ddp")`` on CPU without ``num_nodes``, as Lightning's docs
write it, plus ``plugins=[TidalEnvironment()]`` and ``callbacks=[TidalCallback()]``.
``--sigterm-at STEP --sigterm-rank R`` makes rank R send itself SIGTERM after
that step; ``--kill-at STEP --kill-rank R`` makes rank R SIGKILL itself as step
STEP + 1 begins (a peer that dies mid-step: the others fail in that step's
gradient all-reduce), and rank 0 writes its parameters after step STEP to
``--snapshot``. ``fit(ckpt_path="last")`` resumes from the ModelCheckpoint directory.
Every rank writes ``rank-<RANK>.json``: what Lightning saw (world size, nodes,
the sampler's replicas), where it started and stopped; rank 0 writes the
final parameters to ``--result``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--sigterm-rank", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--snapshot", default="")
    parser.add_argument("--result", default="")
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from checkpoints.frameworks.lightning import TidalCallback, TidalEnvironment

    rank = int(os.environ["RANK"])
    seen: dict[str, Any] = {}

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Watch(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, module: Any) -> None:
            seen.update(start_step=trainer.global_step, world_size=trainer.world_size,
                        num_nodes=trainer.num_nodes, global_rank=trainer.global_rank,
                        replicas=trainer.train_dataloader.sampler.num_replicas)

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            if trainer.global_step == args.kill_at and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if trainer.global_step == args.sigterm_at and rank == args.sigterm_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if trainer.global_step == args.kill_at and rank == 0 and args.snapshot:
                torch.save({k: v.detach().clone() for k, v in module.state_dict().items()},
                           args.snapshot)

    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    tidal = TidalCallback()
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=1, max_steps=args.max_steps,
        plugins=[TidalEnvironment()],
        callbacks=[Watch(), tidal,
                   ModelCheckpoint(dirpath=Path(args.out, "ckpt"), every_n_train_steps=1000)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.out,
    )
    model = Tiny()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        trainer.fit(model, loader, ckpt_path="last")
    finally:
        seen.update(stop_step=tidal.stop_step, end_step=trainer.global_step)
        Path(args.out, f"rank-{rank}.json").write_text(json.dumps(seen), encoding="utf-8")
    if rank == 0 and args.result:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.result)


if __name__ == "__main__":
    main()
