"""One rank of a tiny Hugging Face Trainer job with tidal's callback (run by test_hf.py).

A GPT-2 built from a config (1 layer, 32 wide, a vocabulary of 64; no dropout),
a synthetic dataset fixed by a seed, ``Trainer`` on CPU (gloo when there are
ranks). ``--sigterm-at STEP --sigterm-rank R`` makes rank R send itself SIGTERM
after that step (a deterministic fault); ``--kill-at STEP --kill-rank R`` makes
rank R SIGKILL itself as step STEP + 1 begins (a peer that dies mid-step: the
others fail in that step's gradient all-reduce). The run resumes from the output
directory's last Trainer checkpoint when there is one, as a user's script
would. Rank 0 writes the final parameters to ``--result``; every rank writes
``stopped-rank-<RANK>.json`` with the step the callback stopped at and
``started-rank-<RANK>.json`` with the step training started from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def dataset(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--sigterm-rank", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--result", default="")
    args = parser.parse_args()

    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.trainer_utils import get_last_checkpoint

    from checkpoints.frameworks.hf import TidalCallback

    rank = int(os.environ.get("RANK", "0"))

    class SigtermAt(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == args.sigterm_at and rank == args.sigterm_rank:
                os.kill(os.getpid(), signal.SIGTERM)

    class KillAt(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, f"started-rank-{rank}.json").write_text(
                json.dumps({"step": state.global_step}), encoding="utf-8")

        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == args.kill_at and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=4,
        save_steps=args.save_steps, logging_steps=1, use_cpu=True, report_to=[], seed=0,
        dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-2,
        ddp_timeout=60,  # gloo's default is 30 minutes: a rank left waiting fails in a minute
    )
    tidal = TidalCallback()
    trainer = Trainer(model=model, args=training, train_dataset=dataset(),
                      callbacks=[SigtermAt(), KillAt(), tidal])
    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    print(f"rank {rank} resuming from {last}", flush=True)
    try:
        trainer.train(resume_from_checkpoint=last)
    finally:
        Path(args.out, f"stopped-rank-{rank}.json").write_text(
            json.dumps({"stop_step": tidal.stop_step}), encoding="utf-8")
    if rank == 0 and args.result:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.result)
    print(f"rank {rank} finished at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
