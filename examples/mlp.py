"""A tiny MLP on synthetic data, trained elastically with tidal's ``checkpoints`` library.

It is the smallest complete elastic training script: restore the newest
checkpoint (saved at any world size), draw each step's samples from the
elastic sampler so that the global batch and the sample order do not depend on
the world size, average gradients with DDP over gloo, and checkpoint every few
steps (and on SIGTERM, with exit code 75). The tests use it for the acid test:
a run cut into segments at different world sizes ends with the same parameters
as an uninterrupted one.

Run it with torchrun alone, or under tidal (which sets the same environment)::

    torchrun --standalone --nproc-per-node=2 examples/mlp.py \
        --checkpoint-dir /tmp/mlp --total-steps 60 --dtype float64

It also runs as a plain single process (``python examples/mlp.py ...``).
``--device cuda`` puts the model and the data on the worker's first visible GPU;
the gradients still go over gloo (the GPU check runs three members on one GPU).
Each rank logs one line per step: ``rank R world_size W step S loss L``.

``--live-resize`` lets tidal change the job's nodes without restarting its
workers: the checkpointer re-forms the process group at a step boundary and
calls :meth:`Pipeline.rebuild`, which wraps the model in DDP again and
restarts the sampler at the new rank and world size from the step reached (a
joining worker receives the model, optimizer and RNG state from its peers in
``restore()``). That is why DDP is built after ``restore()``.
A worker whose peer dies (its node is SIGKILLed) keeps its process with
``--live-resize``: the failed step raises out of ``train_step``, the loop
hands the exception to ``Checkpointer.recover``, which re-forms the group
around the survivors and calls the same hook (``Resize.lost``), and the loop
repeats the step from the step it returns. ``--hang-before-step K`` with
``--hang-node NODE`` (fault injection for the tests) makes the workers of node
NODE (``TIDAL_NODE_ID``) stop before step K's forward, after touching
``--hang-file``: the others then wait in step K's gradient all-reduce.
``--slow-node NODE`` with ``--slow-file PATH`` makes the workers of node NODE
take ``--slow-seconds`` more in each step's forward and backward while PATH
exists (a slow node for the straggler tests, whatever else shares the CPU).
``--stop-after-step K`` saves a checkpoint once K steps are complete and exits
0; the next run resumes from it. ``--record PATH`` makes rank 0 write, at the
end, a JSON file with the final parameters and the sample indices every rank
actually received at each step of this run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import checkpoints as ck

log = logging.getLogger("examples.mlp")

GLOO_TIMEOUT = datetime.timedelta(seconds=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = os.environ.get("TIDAL_CHECKPOINT_DIR")  # the job's checkpoint_dir under tidal
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=default_dir, required=default_dir is None,
        help="where checkpoints go (default: $TIDAL_CHECKPOINT_DIR, set by tidal)",
    )
    parser.add_argument("--total-steps", type=int, default=100)
    parser.add_argument(
        "--stop-after-step", type=int, default=None, help="save and exit 0 once K steps are done"
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=int(os.environ.get("TIDAL_GLOBAL_BATCH_SIZE", "32")),
        help="samples per optimizer step over all ranks (default: $TIDAL_GLOBAL_BATCH_SIZE or 32)",
    )
    parser.add_argument("--max-local-batch", type=int, default=None)
    parser.add_argument("--dataset-size", type=int, default=500)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="where the model and data live (cuda: this worker's first visible GPU; the "
        "gradients still go over gloo, so several workers may share one GPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data order and initial weights")
    parser.add_argument("--every-steps", type=int, default=10)
    parser.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--record", type=Path, default=None)
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="pause after each step (demos, tests)"
    )
    parser.add_argument("--hang-before-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hang-node", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hang-file", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--slow-node", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--slow-file", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--slow-seconds", type=float, default=0.5, help=argparse.SUPPRESS)
    parser.add_argument(
        "--live-resize", action="store_true",
        help="take planned resizes live: re-form the process group instead of restarting",
    )
    return parser.parse_args(argv)


class SyntheticRegression(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """``y = sin(x . w) + noise``, the same on every rank and every run; items carry their index."""

    def __init__(self, *, size: int, features: int, dtype: torch.dtype,
                 device: str = "cpu") -> None:
        generator = torch.Generator().manual_seed(1234)
        x = torch.randn(size, features, generator=generator, dtype=dtype)
        w = torch.randn(features, 1, generator=generator, dtype=dtype)
        noise = torch.randn(size, 1, generator=generator, dtype=dtype)
        # Drawn on the CPU, so the data is the same whatever the device.
        self.x, self.y = x.to(device), (torch.sin(x @ w) + 0.1 * noise).to(device)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def make_model(args: argparse.Namespace, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(args.seed)
    return nn.Sequential(
        nn.Linear(args.features, args.hidden, dtype=dtype),
        nn.Tanh(),
        nn.Linear(args.hidden, args.hidden, dtype=dtype),
        nn.Tanh(),
        nn.Linear(args.hidden, 1, dtype=dtype),
    )


def setup_distributed() -> tuple[int, int]:
    """Join the job's process group if launched by torchrun/tidal; return (rank, world size)."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def train_step(
    model: nn.Module,
    batches: Any,
    plan: ck.BatchPlan,
    optimizer: torch.optim.Optimizer,
    *,
    pause: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """One optimizer step over this rank's micro-batches; returns (local mean loss, samples).

    ``pause`` (fault injection) is called between each forward and its backward.
    """
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    samples: list[int] = []
    for i in range(plan.accumulation_steps):
        x, y, index = next(batches)
        # Gradients are all-reduced only on the step's last micro-batch.
        last = i == plan.accumulation_steps - 1
        no_sync = getattr(model, "no_sync", None)
        sync_ctx = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
        with sync_ctx:
            per_sample = ((model(x) - y) ** 2).sum(dim=1)
            if pause is not None:
                pause()
            (per_sample.sum() * plan.loss_scale).backward()
        loss_sum += per_sample.detach().sum().to(loss_sum.dtype)
        samples.extend(index.tolist())
    optimizer.step()
    return loss_sum / plan.local_batch_size, samples


class Pipeline:
    """What depends on the process group: the DDP wrapper and the data loader.

    Built after ``restore()``, and rebuilt by the checkpointer's ``on_resize``
    when a live resize changed the rank and world size: the sampler starts at
    the step reached, so the global sample order does not change.
    """

    def __init__(self, args: argparse.Namespace, model: nn.Module, dataset: SyntheticRegression,
                 *, end_step: int) -> None:
        self.args, self.model, self.dataset, self.end_step = args, model, dataset, end_step

    def rebuild(self, *, rank: int, world_size: int, step: int) -> None:
        """DDP over the current process group; the sampler of ``rank`` from ``step`` on."""
        self.rank, self.world_size = rank, world_size
        self.ddp_model = DistributedDataParallel(self.model) if world_size > 1 else self.model
        self.sampler = ck.ElasticBatchSampler(
            dataset_len=len(self.dataset),
            global_batch_size=self.args.global_batch_size,
            rank=rank,
            world_size=world_size,
            seed=self.args.seed,
            start_step=step,
            max_local_batch=self.args.max_local_batch,
            end_step=max(self.end_step, step),
        )
        self.batches = iter(
            DataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.args.num_workers)
        )

    def on_resize(self, resize: ck.Resize) -> None:
        """The checkpointer's hook: the group was re-formed, the state synced at ``resize.step``
        (after a member was lost: the step to repeat, the sampler rewinds to it)."""
        log.info("resized from %d to %d ranks at step %d%s: now rank %d",
                 resize.previous_world_size, resize.world_size, resize.step,
                 " after a member was lost" if resize.lost else "", resize.rank)
        self.rebuild(rank=resize.rank, world_size=resize.world_size, step=resize.step)


def maybe_hang(args: argparse.Namespace, step: int) -> None:
    """Fault injection: this node's workers stop before ``--hang-before-step`` (until killed)."""
    if args.hang_before_step != step or os.environ.get("TIDAL_NODE_ID") != args.hang_node:
        return
    if args.hang_file is not None:
        args.hang_file.touch()
    log.warning("hanging before step %d (fault injection)", step)
    while True:
        time.sleep(3600)


def slow_pause(args: argparse.Namespace) -> Callable[[], None] | None:
    """Fault injection: on ``--slow-node``, a pause of ``--slow-seconds`` while ``--slow-file``
    exists (inside the step's own work, which :mod:`checkpoints.pace` times)."""
    if args.slow_node is None or os.environ.get("TIDAL_NODE_ID") != args.slow_node:
        return None
    if args.slow_file is None:
        raise SystemExit("--slow-node needs --slow-file")
    slow_file, seconds = args.slow_file, args.slow_seconds

    def pause() -> None:
        if slow_file.exists():
            time.sleep(seconds)

    return pause


def write_record(
    path: Path, *, model: nn.Module, first_step: int, taken: list[list[Any]]
) -> None:
    """Rank 0 writes the final parameters and every rank's samples per step (atomically).

    ``taken`` holds ``[step, rank, samples]`` for each step this process ran
    (its rank may change with a live resize); a step's samples are its ranks'
    in rank order. Only the ranks still in the job at the end contribute.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    per_rank: list[Any] = [taken]
    if world_size > 1:
        per_rank = [None] * world_size
        dist.gather_object(taken, per_rank if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return
    by_step: dict[int, list[tuple[int, list[int]]]] = {}
    for entries in per_rank:
        for step, rank, samples in entries:
            by_step.setdefault(step, []).append((rank, samples))
    steps = [
        {"step": step, "samples": [i for _, samples in sorted(by_step[step]) for i in samples]}
        for step in sorted(by_step)
    ]
    record = {
        "world_size": world_size,
        "first_step": first_step,
        "steps": steps,
        "params": {
            name: {"shape": list(t.shape), "values": t.detach().flatten().tolist()}
            for name, t in model.state_dict().items()
        },
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def train(args: argparse.Namespace, *, rank: int, world_size: int) -> None:
    """Restore, train until ``--total-steps`` or ``--stop-after-step``, save, record."""
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    model = make_model(args, dtype).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    end_step = args.total_steps
    if args.stop_after_step is not None:
        end_step = min(end_step, args.stop_after_step)
    dataset = SyntheticRegression(size=args.dataset_size, features=args.features, dtype=dtype,
                                  device=args.device)
    pipeline = Pipeline(args, model, dataset, end_step=end_step)
    ckpt = ck.Checkpointer(
        args.checkpoint_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        every_steps=args.every_steps,
        async_save=args.async_save,
        on_resize=pipeline.on_resize if args.live_resize else None,
    )
    resume = ckpt.restore()  # a worker that joins live receives its peers' state here
    log.info(
        "start at step %d (fresh=%s, saved at world size %s), world_size %d",
        resume.step,
        resume.fresh,
        resume.saved_world_size,
        world_size,
    )
    pipeline.rebuild(rank=rank, world_size=world_size, step=resume.step)  # DDP after restore
    taken: list[list[Any]] = []
    step = resume.step
    pause = slow_pause(args)
    while step < end_step:
        maybe_hang(args, step)
        try:
            loss, samples = train_step(pipeline.ddp_model, pipeline.batches,
                                       pipeline.sampler.plan, optimizer, pause=pause)
        except Exception as exc:
            # A peer died during the step: with --live-resize the group re-forms
            # around the survivors and the step is repeated (else this raises again).
            step = ckpt.recover(exc)
            continue
        scheduler.step()
        taken.append([step, pipeline.rank, samples])
        log.info("rank %d world_size %d step %d loss %.6f",
                 pipeline.rank, pipeline.world_size, step, loss)
        step += 1
        # May resize live: the pipeline is rebuilt for the next step.
        ckpt.maybe_save(step, loss=loss, samples=args.global_batch_size)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    if step > resume.step:
        ckpt.save(step)
    ckpt.close()
    log.info("done at step %d", step)
    if args.record is not None:
        write_record(args.record, model=model, first_step=resume.step, taken=taken)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size = setup_distributed()
    # The process id, not the rank: a live resize may change the rank.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [pid %(process)d] %(message)s")
    try:
        train(args, rank=rank, world_size=world_size)
        if dist.is_initialized():
            # Every rank is done with its collectives before any tears the group down:
            # a rank whose peer closed its gloo connections with an operation of its own
            # still pending can abort at exit (seen once under load: SIGABRT after "done").
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
