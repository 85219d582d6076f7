"""A plain torchrun DDP script with no tidal code in it, for the etcd-v3 plugin demo.

It trains a tiny float64 linear regression with DistributedDataParallel over
gloo, one global step every ``--step-seconds``, and shows what elastic training
needs from a script and nothing more:

* each node keeps its own checkpoint file (``--checkpoint``, written
  atomically every step by every rank); at start, ranks agree on the newest
  step any of them holds and take the model from that rank, so a node that
  joins with no checkpoint catches up from the others;
* one JSON line per step is appended to ``--events`` (node, rank, world size,
  step, restart count), which the demo and the tests read;
* the job ends when ``--stop-file`` exists (checked by rank 0, agreed by all)
  or after ``--max-steps``.

Run it with, for example::

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=demo \
        --nnodes=1:3 --nproc-per-node=1 examples/elastic_ddp.py --checkpoint /tmp/a.pt
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from checkpoints.protocol import env as worker_env


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--events", type=Path, default=None)
    parser.add_argument("--stop-file", type=Path, default=None)
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument(
        "--node-name",
        default=os.environ.get(worker_env.NODE_ID)
        or os.environ.get("NODE_NAME")
        or os.uname().nodename,
    )
    args = parser.parse_args()
    # "{node}" in the checkpoint path gives each node its own file.
    args.checkpoint = Path(str(args.checkpoint).format(node=args.node_name))
    return args


def load_or_init(path: Path) -> tuple[int, torch.nn.Module]:
    model = torch.nn.Linear(4, 1, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    step = 0
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        step = int(state["step"])
    return step, model


def agree_on_state(step: int, model: torch.nn.Module) -> int:
    """Every rank takes the model and step of the rank with the newest checkpoint."""
    world = dist.get_world_size()
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([step], dtype=torch.int64))
    best = max(range(world), key=lambda r: (int(steps[r].item()), -r))
    for param in model.parameters():
        dist.broadcast(param.data, src=best)
    return int(steps[best].item())


def save(path: Path, step: int, model: torch.nn.Module) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    step, model = load_or_init(args.checkpoint)
    step = agree_on_state(step, model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    target_w = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    try:
        while step < args.max_steps:
            gen = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(8, 4, dtype=torch.float64, generator=gen)
            loss = torch.nn.functional.mse_loss(ddp(x), x @ target_w.T)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            save(args.checkpoint, step, model)
            if events:
                record = {
                    "node": args.node_name, "rank": rank, "world_size": world, "step": step,
                    "restarts": restarts, "loss": loss.item(), "time": time.time(),
                }
                events.write(json.dumps(record) + "\n")
                events.flush()
            stop = torch.tensor([1 if args.stop_file and args.stop_file.exists() else 0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            time.sleep(args.step_seconds)
    finally:
        if events:
            events.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
