"""A Hugging Face ``Trainer`` job for tidal: a tiny GPT-2 built from a config, on CPU.

Nothing is downloaded: the model is ``GPT2LMHeadModel(GPT2Config(...))`` (2
layers, 64 wide, a vocabulary of 128) and the data are random token ids fixed
by a seed. The script is what docs/frameworks.md shows: ``callbacks=[TidalCallback()]``
and ``trainer.train(resume_from_checkpoint=...)`` from the output directory's
last ``checkpoint-<step>``; ``--no-callback`` runs the same Trainer without
tidal's callback (a plain torchrun-style script), for comparison.

Run it under tidal (``tidal submit --zygote-preload transformers,transformers.trainer
--min-nodes 2 --max-nodes 3 -- python examples/hf_trainer.py --out DIR``) or
plain ``torchrun``. ``--step-seconds`` paces the steps (a sleep after each) so
that a few CPU workers on a small machine train at a steady rate;
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def dataset(n: int = 512, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of random token ids (a fixed seed), each its own label."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 128, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


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
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--save-steps", type=int, default=25,
                        help="the Trainer's own periodic checkpoint, every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--events", default="", help="rank 0 appends its steps here (JSON lines)")
    parser.add_argument("--stop-file", default="",
                        help="once this file holds a step number, every rank stops after "
                             "that step (how a test ends a job of unknown length)")
    parser.add_argument("--no-callback", action="store_true",
                        help="leave tidal's TidalCallback out (a plain Trainer script)")
    opts = parser.parse_args()

    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.trainer_utils import get_last_checkpoint

    rank = int(os.environ.get("RANK", "0"))

    class Pace(TrainerCallback):  # type: ignore[misc]
        """Rank 0's steps to ``--events``; a sleep after each step (``--step-seconds``);
        the stop at ``--stop-file``'s step."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == 0 and opts.events:
                append_event(opts.events, "start", state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == 0 and opts.events:
                append_event(opts.events, "step", state.global_step)
            stop = stop_step(opts.stop_file) if opts.stop_file else None
            if stop is not None and state.global_step >= stop:
                control.should_training_stop = True
            elif opts.step_seconds:
                time.sleep(opts.step_seconds)

    callbacks: list[Any] = [Pace()]
    if not opts.no_callback:
        from checkpoints.frameworks.hf import TidalCallback

        callbacks.append(TidalCallback())
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    training = TrainingArguments(
        output_dir=opts.out, max_steps=opts.max_steps, per_device_train_batch_size=4,
        save_steps=opts.save_steps, logging_steps=10, use_cpu=True, report_to=[], seed=0,
        dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3,
        ddp_timeout=60,  # gloo's default is 30 minutes: a rank left waiting fails in a minute
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, train_dataset=dataset(),
                      callbacks=callbacks)
    last = get_last_checkpoint(opts.out) if os.path.isdir(opts.out) else None  # type: ignore[no-untyped-call]
    print(f"rank {rank} resuming from {last}", flush=True)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    trainer.train(resume_from_checkpoint=last)
    print(f"rank {rank} finished at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
