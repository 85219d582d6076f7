"""Part 5's worker: a training process that times each stage of its own start.

``python -m tests.gpu.worker_restart MARKS_DIR --size 200m`` (a tidal job with
one GPU) joins its process group (NCCL on a GPU, gloo on the CPU), builds
examples/charlm.py's model with AdamW, restores the newest checkpoint from the
job's checkpoint directory (``checkpoints.Checkpointer``), takes a first step,
and writes ``MARKS_DIR/marks-<pid>.json`` with the Unix time at which each stage
ended (:data:`STAGES`) and the process's own start (``/proc``, so the time
between a kill and the replacement's ``fork``/``exec`` is seen too). A first
run (nothing to restore) saves a checkpoint at ``--save-at`` (synchronously:
this measures the restart, not the save) and says so in its marks; every run
then trains on until ``--max-steps`` or until it is killed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

from tests.gpu.procs import process_start_time

#: The stages, in order, each the Unix time it ended.
STAGES = ("process_start", "imports", "cuda_init", "group_init", "model_built", "state_loaded",
          "first_step")


def write_marks(marks_dir: Path, marks: dict[str, Any]) -> None:
    path = marks_dir / f"marks-{os.getpid()}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(marks))
    os.replace(tmp, path)  # never read half-written


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("marks_dir", type=Path)
    parser.add_argument("--size", default="200m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=100_000)
    args = parser.parse_args()
    marks: dict[str, Any] = {"pid": os.getpid(),
                             "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                             "process_start": process_start_time(os.getpid())}

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import checkpoints as ck
    from examples.charlm import SIZES, VOCAB, CharLM
    from tests.gpu import compat

    marks["imports"] = time.time()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    marks["cuda_init"] = time.time()
    marks["backend"] = "nccl" if cuda else "gloo"
    dist.init_process_group(marks["backend"], timeout=datetime.timedelta(seconds=60),
                            device_id=device if cuda else None)
    dist.all_reduce(torch.ones(1, device=device))  # the communicator exists after this
    if cuda:
        torch.cuda.synchronize()
    marks["group_init"] = time.time()

    config = dict(SIZES[args.size])
    if args.block_size:
        config["block_size"] = args.block_size
    torch.manual_seed(0)
    model = CharLM(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    marks["model_built"] = time.time()
    env = compat.module("checkpoints.protocol.env", "rendezvous.worker_env")
    ckpt = ck.Checkpointer(os.environ[env.CHECKPOINT_DIR], model=model, optimizer=optimizer,
                           keep=1, async_save=False, jit_save=False, handle_sigterm=False)
    resume = ckpt.restore()
    if cuda:
        torch.cuda.synchronize()
    marks["state_loaded"] = time.time()
    marks["resumed_step"] = resume.step
    marks["parameters"] = sum(p.numel() for p in model.parameters())

    x = torch.randint(0, VOCAB, (args.batch, config["block_size"]), device=device)
    y = torch.randint(0, VOCAB, (args.batch, config["block_size"]), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        optimizer.step()

    step()
    if cuda:
        torch.cuda.synchronize()
    marks["first_step"] = time.time()
    write_marks(args.marks_dir, marks)

    done = resume.step + 1
    while done < args.max_steps:
        step()
        done += 1
        if resume.fresh and done == args.save_at:
            if cuda:
                torch.cuda.synchronize()
            started = time.time()
            ckpt.save(done)
            marks["saved_step"], marks["save_s"] = done, time.time() - started
            write_marks(args.marks_dir, marks)
        if cuda and done % 10 == 0:
            torch.cuda.synchronize()  # keep the host near the device
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
