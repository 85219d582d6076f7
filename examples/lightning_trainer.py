"""A Lightning job for tidal: a tiny ``LightningModule`` (a small MLP regression), on CPU.

The script is what docs/frameworks.md shows: ``Trainer(strategy="ddp",
plugins=[TidalEnvironment()], callbacks=[TidalCallback(), ModelCheckpoint(...)])``
and ``fit(ckpt_path="last")`` once ``last.ckpt`` exists. ``--no-callback``
runs it as a plain torchrun-style Lightning script instead: no tidal import,
``num_nodes`` taken from ``WORLD_SIZE`` at each start (Lightning's own
``TorchElasticEnvironment`` insists on it), Lightning's own SIGTERM handling.

Run it under tidal (``tidal submit --zygote-preload lightning --min-nodes 2
--max-nodes 3 -- python examples/lightning_trainer.py --out DIR``) or plain
``torchrun``. ``--step-seconds`` paces the steps (a sleep after each);
``--events FILE`` makes rank 0 append one JSON line per step (``{"kind":
"step", "step", "world_size", "node", "time"}``) and one as training starts
(``"kind": "start"``, the step it resumed from), which tests/support/frameworks.py reads
(the benchmark and the end-to-end tests); ``--stop-file FILE`` ends a job of
unknown length: once FILE holds a step number, every rank stops after it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch


def append_event(path: str, kind: str, step: int) -> None:
    """One JSON line, appended (O_APPEND: whole lines from every attempt, in order)."""
    record = {"kind": kind, "step": step, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
              "node": os.environ.get("TIDAL_NODE_ID", ""), "time": time.time()}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def stop_step(path: str) -> int | None:
    """The step ``--stop-file`` names, once it exists (None before)."""
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="ModelCheckpoint's directory is OUT/ckpt")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--save-steps", type=int, default=25,
                        help="ModelCheckpoint(every_n_train_steps=N, save_last=True)")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--events", default="", help="rank 0 appends its steps here (JSON lines)")
    parser.add_argument("--stop-file", default="",
                        help="once this file holds a step number, every rank stops after "
                             "that step (how a test ends a job of unknown length)")
    parser.add_argument("--no-callback", action="store_true",
                        help="a plain Lightning script: no TidalCallback, no TidalEnvironment")
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    rank = int(os.environ.get("RANK", "0"))

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Pace(pl.Callback):  # type: ignore[misc]
        """Rank 0's steps to ``--events``; a sleep after each step (``--step-seconds``);
        the stop at ``--stop-file``'s step."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if rank == 0 and args.events:
                append_event(args.events, "start", trainer.global_step)

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if rank == 0 and args.events:
                append_event(args.events, "step", trainer.global_step)
            stop = stop_step(args.stop_file) if args.stop_file else None
            if stop is not None and trainer.global_step >= stop:
                trainer.should_stop = True
            elif args.step_seconds:
                time.sleep(args.step_seconds)

    ckpt_dir = Path(args.out, "ckpt")
    callbacks: list[Any] = [
        Pace(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.save_steps,
                                save_last=True),
    ]
    options: dict[str, Any] = {}
    if args.no_callback:
        options["num_nodes"] = int(os.environ.get("WORLD_SIZE", "1"))  # one device a node
    else:
        from checkpoints.frameworks.lightning import TidalCallback, TidalEnvironment

        callbacks.append(TidalCallback())
        options["plugins"] = [TidalEnvironment()]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1024, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=1, max_steps=args.max_steps,
        callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out, **options,
    )
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    resume = "last" if (ckpt_dir / "last.ckpt").exists() else None
    trainer.fit(Tiny(), loader, ckpt_path=resume)


if __name__ == "__main__":
    main()
