"""Worker processes for the checkpoint integration tests, and helpers to launch them.

Run as a script, it is one rank of a small training job (``train``), a
process that forks savers for the tests to kill (``zygote``), one rank of
an FSDP2 job that saves or loads sharded state (``sharded``), or one rank of
a step-flags exchange whose peer stops taking part (``consensus``). Ranks of a
multi-process job meet through a FileStore (``--init-file``), so no port can
be taken by someone else between choosing it and binding it. Every line a
worker logs is flushed at once; the tests wait on those lines.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import checkpoints as ck  # noqa: E402  (after the path fix when run as a script)
from checkpoints.jit import is_collective_failure  # noqa: E402
from checkpoints.signals import StepConsensus  # noqa: E402

log = logging.getLogger("ckpt_worker")
SCRIPT = Path(__file__).resolve()


def worker_argv(mode: str, *args: str) -> list[str]:
    """The command line that runs this file as a worker."""
    return [sys.executable, str(SCRIPT), mode, *args]


def worker_env(*, rank: int, world_size: int) -> dict[str, str]:
    """The environment of one rank: no TIDAL_* leaks in, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def make_mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 1, dtype=torch.float64),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends on the step and rank only, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def init_distributed(init_file: str | None, timeout_s: float = 60) -> tuple[int, int]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return rank, world_size


def train(args: argparse.Namespace) -> None:
    """Train until ``--total-steps`` (or a stop), logging ``rank R completed step S``."""
    rank, world_size = init_distributed(args.init_file)
    model = make_mlp(args.width)
    wrapped: torch.nn.Module = model
    if world_size > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = ck.Checkpointer(
        args.dir, model=model, optimizer=optimizer, every_steps=args.every_steps, keep=2
    )
    resume = ckpt.restore()
    log.info("rank %d resumed at step %d fresh %s", rank, resume.step, resume.fresh)
    for step in range(resume.step, args.total_steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        log.info("rank %d completed step %d", rank, step + 1)
        ckpt.maybe_save(step + 1)
        if args.pace:
            time.sleep(args.pace)
    ckpt.save(args.total_steps)
    ckpt.close()
    log.info("rank %d finished at step %d", rank, args.total_steps)
    if dist.is_initialized():
        dist.destroy_process_group()


def zygote(args: argparse.Namespace) -> None:
    """Fork savers one after another; each waits for ``<control>/go-<i>`` before starting."""
    torch.set_num_threads(1)
    control = Path(args.control)
    for index in range(args.children):
        deadline = time.monotonic() + 60
        while not (control / f"go-{index}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no go-{index} from the test within 60 s")
            time.sleep(0.01)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                saver(args, async_save=index % 2 == 0)
            except BaseException:
                log.exception("saver failed")
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        log.info("child %d ended with status %d", pid, status)


def saver(args: argparse.Namespace, *, async_save: bool) -> None:
    """Restore, then save after every step, forever (until killed)."""
    model = make_mlp(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = ck.Checkpointer(
        args.dir,
        model=model,
        optimizer=optimizer,
        every_steps=1,
        keep=2,
        async_save=async_save,
        handle_sigterm=False,
    )
    resume = ckpt.restore()
    log.info("child %d restored step %d, saving", os.getpid(), resume.step)
    step = resume.step
    while True:
        x, y = batch(step, 0)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        step += 1
        ckpt.maybe_save(step)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded model and optimizer state (collective: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": dict(model_sd), "optimizer": optim_sd["state"]}


def sharded(args: argparse.Namespace) -> None:
    """FSDP2 over gloo: train and save (``--save``) or restore, then dump the full state."""
    from torch.distributed.fsdp import fully_shard

    rank, world_size = init_distributed(args.init_file)
    if world_size == 1:  # FSDP2 needs a process group even for one rank
        dist.init_process_group(
            "gloo", init_method=f"file://{args.init_file}", rank=0, world_size=1
        )
    model = make_mlp(args.width)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    ckpt = ck.Checkpointer(
        args.dir, model=model, optimizer=optimizer, scheduler=scheduler, sharded=True
    )
    resume = ckpt.restore()
    if args.save:
        for step in range(3):
            x, y = batch(step, rank)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
        ckpt.save(3)
    ckpt.close()
    state = full_state(model, optimizer)
    state["resumed_step"] = resume.step
    state["scheduler"] = scheduler.state_dict()["last_epoch"]
    if rank == 0:
        torch.save(state, args.dump)
    log.info("rank %d done (world size %d, resumed at %d)", rank, world_size, resume.step)
    dist.destroy_process_group()


def consensus(args: argparse.Namespace) -> None:
    """Rank 0 exchanges step flags twice; rank 1 never does, and waits for ``<control>/go``.

    The flags' group has the checkpointer's 10-minute timeout; the training
    group has ``--timeout``. Rank 0 logs how its second exchange (which drains
    the first) ended.
    """
    rank, _ = init_distributed(args.init_file, timeout_s=args.timeout)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
    if rank == 0:
        flags = StepConsensus(group, width=2)
        flags.exchange([1, 0])
        started = time.monotonic()
        try:
            flags.exchange([0, 0])
        except Exception as exc:  # the point: it fails, and how
            log.info("drain failed after %.1f s (collective failure %s): %s",
                     time.monotonic() - started, is_collective_failure(exc), exc)
            os._exit(3)  # the group's destructor would wait for the peer's part
        log.info("drain completed")
        os._exit(0)
    deadline = time.monotonic() + 120
    while not (Path(args.control) / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no go from the test within 120 s")
        time.sleep(0.05)
    os._exit(0)


def destroy(args: argparse.Namespace) -> None:
    """Both ranks exchange step flags, then destroy the flags' group; each logs its thread
    count before and after (``threads before N after M``)."""
    init_distributed(args.init_file)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
    flags = StepConsensus(group, width=2)
    del group  # the consensus holds the only reference, as in the checkpointer
    for step in range(5):
        flags.exchange([step, 0])
    flags.drain()
    before = len(os.listdir("/proc/self/task"))
    flags.destroy()
    after = len(os.listdir("/proc/self/task"))
    log.info("threads before %d after %d", before, after)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "zygote", "sharded", "consensus", "destroy"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--total-steps", type=int, default=10**9)
    parser.add_argument("--every-steps", type=int, default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--init-file", default=None)
    parser.add_argument("--control", default=None)
    parser.add_argument("--children", type=int, default=0)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--dump", default=None)
    parser.add_argument("--timeout", type=float, default=60, help="the training group's (s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck test dumps the stacks
    modes = {"train": train, "zygote": zygote, "sharded": sharded, "consensus": consensus,
             "destroy": destroy}
    modes[args.mode](args)


if __name__ == "__main__":
    main()
