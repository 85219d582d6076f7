"""A small character-level transformer language model, trained elastically on Python's own source.

The corpus ships with Python itself, so nothing is downloaded: the standard
library's top-level ``*.py`` files, in sorted order, concatenated (capped at
``--corpus-bytes``). Characters are UTF-8 bytes (a vocabulary of 256); a
sample is one window of ``--block-size`` bytes and the byte after each.

What it shows, beyond examples/mlp.py:

* batches come from a ``DataLoader`` with worker processes (``--num-workers``)
  driven by ``checkpoints.ElasticBatchSampler``, so a job resumed at another
  world size continues the same sample stream with the same global batch;
* on a GPU it trains with NCCL and bf16 autocast (``--amp auto``); on CPU the
  same script uses gloo and float32 (``--amp bf16`` forces autocast on CPU);
* ``checkpoints.Checkpointer`` saves model, optimizer and LR schedule every
  ``--every-steps`` and on SIGTERM (exit code 75), and restores at any world size.

Run it with torchrun alone, or under tidal::

    torchrun --standalone --nproc-per-node=2 examples/charlm.py --checkpoint-dir /tmp/charlm

On a GPU machine, the ~200M-parameter model (bf16 autocast, DDP over NCCL, one
worker per GPU; a worker that is stopped while a peer is dead aborts NCCL
instead of waiting for its timeout, see checkpoints/nccl.py)::

    tidal submit --gpus-per-node 1 --checkpoint-dir charlm -- \
        python examples/charlm.py --size 200m --total-steps 500

A tiny configuration that runs a few steps on CPU in seconds::

    torchrun --standalone --nproc-per-node=2 examples/charlm.py --checkpoint-dir /tmp/c \
        --total-steps 5 --n-layer 1 --d-model 32 --n-head 2 --block-size 32 \
        --global-batch-size 8 --corpus-bytes 100000
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import checkpoints as ck
from checkpoints import nccl
from checkpoints.protocol import env as worker_env

log = logging.getLogger("examples.charlm")

VOCAB = 256
#: Model sizes for --size: 12 d_model^2 + 13 d_model parameters per layer, plus the
#: embeddings and the head. "200m" is the GPU example: 203M parameters, whose
#: model + AdamW state is 2.4 GB in float32 (bf16 autocast computes in bf16).
SIZES: dict[str, dict[str, int]] = {
    "small": {"block_size": 128, "n_layer": 4, "n_head": 4, "d_model": 256},
    "200m": {"block_size": 512, "n_layer": 16, "n_head": 16, "d_model": 1024},
}
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = os.environ.get(worker_env.CHECKPOINT_DIR)  # the job's checkpoint_dir under tidal
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=default_dir, required=default_dir is None,
        help="where checkpoints go (default: $TIDAL_CHECKPOINT_DIR, set by tidal)",
    )
    parser.add_argument("--total-steps", type=int, default=2000)
    parser.add_argument("--stop-after-step", type=int, default=None)
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=int(os.environ.get(worker_env.GLOBAL_BATCH_SIZE, "64")),
        help="sequences per step over all ranks (default: $TIDAL_GLOBAL_BATCH_SIZE or 64)",
    )
    parser.add_argument("--max-local-batch", type=int, default=None)
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="small",
        help="a model size: small (3.3M parameters) or 200m (203M, for a GPU: bf16 "
        "autocast, DDP over NCCL); --block-size, --n-layer, --n-head, --d-model override it",
    )
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--n-head", type=int, default=None)
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--corpus-bytes", type=int, default=8_000_000)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto")
    parser.add_argument("--sample-bytes", type=int, default=0, help="generate this much at the end")
    parser.add_argument("--log-every", type=int, default=10, help="log (and sync) every N steps")
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's top-level modules, sorted by name, as one byte tensor."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes() + b"\n"
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Non-overlapping windows of ``block_size`` bytes; the target is the next byte of each."""

    def __init__(self, corpus: torch.Tensor, block_size: int) -> None:
        if len(corpus) <= block_size:
            raise ValueError(f"the corpus ({len(corpus)} bytes) is shorter than one block")
        self.corpus = corpus
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = index * self.block_size
        chunk = self.corpus[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:], index


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class CharLM(nn.Module):
    def __init__(self, *, block_size: int, n_layer: int, n_head: int, d_model: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) is not a multiple of n_head ({n_head})")
        self.block_size = block_size
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(positions))
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def setup_distributed(device_choice: str) -> tuple[int, int, torch.device]:
    """Join the job's process group (NCCL on GPU, gloo on CPU); return rank, world, device."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    backend = "nccl" if use_cuda else "gloo"
    device_id = device if use_cuda else None
    if use_cuda:
        nccl.prepare_environment()  # a failed collective raises instead of hanging
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=device_id)
    return dist.get_rank(), dist.get_world_size(), device


def lr_factor(warmup_steps: int, total_steps: int) -> Any:
    """Linear warm-up, then cosine decay to a tenth."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train_step(
    model: nn.Module,
    batches: Any,
    plan: ck.BatchPlan,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    amp: bool,
) -> tuple[torch.Tensor, list[int]]:
    """One optimizer step over this rank's micro-batches; returns (mean loss per byte, samples)."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    samples: list[int] = []
    for i in range(plan.accumulation_steps):
        x, y, index = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = i == plan.accumulation_steps - 1
        no_sync = getattr(model, "no_sync", None)
        sync_ctx = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
        with sync_ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
            # A sample's loss is its mean over the window; the plan weights the sum of samples.
            token_loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
            sample_loss_sum = token_loss / x.shape[1]
            (sample_loss_sum * plan.loss_scale).backward()
        loss_sum += sample_loss_sum.detach()
        samples.extend(index.tolist())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss_sum / plan.local_batch_size, samples


@torch.no_grad()
def generate(model: CharLM, prompt: bytes, length: int, device: torch.device) -> str:
    """Greedy continuation of ``prompt``, as text."""
    idx = torch.tensor([list(prompt)], device=device)
    for _ in range(length):
        logits = model(idx[:, -model.block_size :])
        idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def write_record(path: Path, *, world_size: int, first_step: int, taken: list[Any]) -> None:
    """Rank 0 writes every rank's samples per step of this run (atomically)."""
    per_rank: list[Any] = [None] * world_size
    if world_size > 1:
        dist.gather_object(taken, per_rank if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return
    else:
        per_rank = [taken]
    steps = [
        {"step": entries[0][0], "samples": [i for entry in entries for i in entry[1]]}
        for entries in zip(*per_rank, strict=True)
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"world_size": world_size, "first_step": first_step, "steps": steps}))
    os.replace(tmp, path)


def build(args: argparse.Namespace, device: torch.device) -> tuple[CharLM, CharWindows]:
    torch.manual_seed(args.seed)
    model = CharLM(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model
    ).to(device)
    dataset = CharWindows(load_corpus(args.corpus_bytes), args.block_size)
    return model, dataset


def make_loader(
    args: argparse.Namespace,
    dataset: CharWindows,
    *,
    rank: int,
    world_size: int,
    start_step: int,
    end_step: int,
) -> tuple[ck.ElasticBatchSampler, DataLoader[Any]]:
    """A DataLoader with worker processes, fed this rank's batches from ``start_step`` on."""
    sampler = ck.ElasticBatchSampler(
        dataset_len=len(dataset),
        global_batch_size=args.global_batch_size,
        rank=rank,
        world_size=world_size,
        seed=args.seed,
        start_step=start_step,
        max_local_batch=args.max_local_batch,
        end_step=max(end_step, start_step),
    )
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=torch.cuda.is_available() and args.device != "cpu",
    )
    return sampler, loader


def train(args: argparse.Namespace, *, rank: int, world_size: int, device: torch.device) -> None:
    """Restore, train until ``--total-steps`` or ``--stop-after-step``, save, record."""
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    model, dataset = build(args, device)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp_model = DistributedDataParallel(model, device_ids=device_ids) if world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor(args.warmup_steps, args.total_steps)
    )
    ckpt = ck.Checkpointer(
        args.checkpoint_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        every_steps=args.every_steps,
        total_steps=args.total_steps,  # tidal submit / status --watch show the time left
    )
    resume = ckpt.restore()
    # A peer that dies mid-collective would hold NCCL for the group's timeout:
    # abort it shortly after the runner's SIGTERM instead (checkpoints.nccl).
    watcher = nccl.abort_on_stop() if device.type == "cuda" and world_size > 1 else None
    log.info(
        "start at step %d (fresh=%s, saved at world size %s), world_size %d, device %s, "
        "bf16 %s, %d parameters, %d samples of %d bytes",
        resume.step,
        resume.fresh,
        resume.saved_world_size,
        world_size,
        device,
        amp,
        sum(p.numel() for p in model.parameters()),
        len(dataset),
        args.block_size,
    )
    end_step = args.total_steps
    if args.stop_after_step is not None:
        end_step = min(end_step, args.stop_after_step)
    sampler, loader = make_loader(
        args, dataset, rank=rank, world_size=world_size, start_step=resume.step, end_step=end_step
    )
    taken: list[Any] = []
    batches = iter(loader)
    step = resume.step
    while step < end_step:
        started = time.perf_counter()
        loss, samples = train_step(
            ddp_model, batches, sampler.plan, optimizer, device=device, amp=amp
        )
        lr = optimizer.param_groups[0]["lr"]  # the rate this step used
        scheduler.step()
        taken.append([step, samples])
        if step % args.log_every == 0 or step + 1 == end_step:
            log.info(  # float() waits for the device: only on the steps we log
                "rank %d world_size %d step %d loss %.4f lr %.2e %.0f samples/s",
                rank,
                world_size,
                step,
                float(loss),
                lr,
                args.global_batch_size / (time.perf_counter() - started),
            )
        step += 1
        ckpt.maybe_save(step, loss=loss, samples=args.global_batch_size)
    if step > resume.step:
        ckpt.save(step)
    if watcher is not None:
        watcher.close()
    ckpt.close()
    log.info("done at step %d", step)
    if rank == 0 and args.sample_bytes > 0:
        log.info("sample:\n%s", generate(model, b"def ", args.sample_bytes, device))
    if args.record is not None:
        write_record(args.record, world_size=world_size, first_step=resume.step, taken=taken)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size, device = setup_distributed(args.device)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s")
    try:
        train(args, rank=rank, world_size=world_size, device=device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
