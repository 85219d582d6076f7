"""Benchmark: what checkpointing costs a training loop (a ~25M-parameter model, Adam, CPU).

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/bench/bench_checkpoint.py -m bench -s``.
It prints a table (median and worst) of:

* the synchronous reference: ``torch.save`` + fsync of the same state;
* the training-loop stall per save of ``Checkpointer(async_save=True)``;
* the training time *lost* per save: (time of N steps with saves - time of N
  steps with checkpointing off) / saves; on few cores the background writer
  competes with training, and this is what that costs;
* the per-step overhead of the library with checkpointing off (``maybe_save``
  with no schedule) against a loop without it;
* the per-step cost of the stop-flag consensus (all-reduce on a private gloo
  group) with two ranks.

The figures go into docs/benchmarks.md. No assertion is made on time.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoints as ck

WIDTH, LAYERS, BATCH = 2048, 6, 64  # 6 x 2048^2 weights: 25.2M parameters
STEPS, EVERY, ROUNDS, SYNC_SAVES = 48, 8, 3, 5


def make_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()

    step()  # Adam's moments exist from here on
    return model, optimizer, step


def timed_loop(step: Callable[[], None], after: Callable[[int], Any] | None) -> list[float]:
    times = []
    for i in range(STEPS):
        started = time.perf_counter()
        step()
        if after is not None:
            after(i + 1)
        times.append(time.perf_counter() - started)
    return times


def sync_saves(model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> list[float]:
    out = []
    for i in range(SYNC_SAVES):
        path = root / f"sync-{i}.pt"
        started = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        out.append(time.perf_counter() - started)
        path.unlink()
    return out


def consensus_worker(rank: int, init_file: str, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    model = torch.nn.Linear(1, 1)
    with tempfile.TemporaryDirectory() as root:
        ckpt = ck.Checkpointer(root, model=model, handle_sigterm=False)
        for i in range(200):  # warm up
            ckpt.maybe_save(i)
        started = time.perf_counter()
        for i in range(2000):
            ckpt.maybe_save(i)
        per_call = (time.perf_counter() - started) / 2000
        ckpt.close()
    if rank == 0:
        Path(result_file).write_text(repr(per_call))
    dist.destroy_process_group()


def consensus_cost(root: Path) -> float:
    result = root / "consensus.txt"
    mp.start_processes(
        consensus_worker,
        args=(str(root / "init"), str(result)),
        nprocs=2,
        start_method="spawn",
    )
    return float(result.read_text())


def row(name: str, values: list[float], unit: float = 1.0, fmt: str = "{:8.3f}") -> str:
    med, worst = statistics.median(values) * unit, max(values) * unit
    return f"| {name:<52} | {fmt.format(med)} | {fmt.format(worst)} |"


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_bench_checkpoint_stall_and_overhead(tmp_path: Path) -> None:
    model, optimizer, step = make_job()
    params = sum(p.numel() for p in model.parameters())
    sync = sync_saves(model, optimizer, tmp_path)
    stalls: list[float] = []
    lost: list[float] = []
    save_durations: list[float] = []
    off_overhead: list[float] = []
    step_times: list[float] = []
    state_bytes = 0
    for r in range(ROUNDS):
        plain = timed_loop(step, None)
        off = ck.Checkpointer(tmp_path / f"off-{r}", model=model, optimizer=optimizer)
        with_off = timed_loop(step, off.maybe_save)
        off.close()
        on = ck.Checkpointer(
            tmp_path / f"on-{r}", model=model, optimizer=optimizer, every_steps=EVERY, keep=2
        )
        with_saves = timed_loop(step, on.maybe_save)
        on.close()
        done = [s for s in on.saves if s.save_seconds is not None]
        state_bytes = on._snapshot.nbytes
        stalls += [s.stall_seconds for s in done]
        save_durations += [s.save_seconds for s in done if s.save_seconds is not None]
        lost.append((sum(with_saves) - sum(with_off)) / max(len(done), 1))
        off_overhead.append(sum(with_off) / sum(plain) - 1.0)
        step_times += plain
    # The overhead of maybe_save alone, without timing noise from the steps around it.
    idle = ck.Checkpointer(tmp_path / "idle", model=model, optimizer=optimizer)
    started = time.perf_counter()
    for i in range(100_000):
        idle.maybe_save(i)
    per_call = (time.perf_counter() - started) / 100_000
    idle.close()
    consensus = consensus_cost(tmp_path)
    median = statistics.median
    median_step = median(step_times)
    lines = [
        f"model: {params / 1e6:.1f}M parameters + Adam, {state_bytes / 1e6:.0f} MB of state; "
        f"{torch.get_num_threads()} threads; saves every {EVERY} of {STEPS} steps, {ROUNDS} rounds",
        "| measure | median | worst |",
        "|---|---|---|",
        row("training step (s)", step_times),
        row("sync torch.save + fsync, blocks (s)", sync),
        row("async save: training-loop stall per save (s)", stalls),
        row("async save: stall / sync save (%)", [s / median(sync) for s in stalls], 100),
        row("async save: time lost per save, stall included (s)", lost),
        row("async save: background save duration (s)", save_durations),
        row("checkpointing off: step-time overhead, loop (%)", off_overhead, 100),
        row("checkpointing off: maybe_save per call (us)", [per_call], 1e6, "{:8.1f}"),
        row("checkpointing off: maybe_save / step (%)", [per_call / median_step], 100, "{:8.4f}"),
        row("2 ranks: maybe_save with stop consensus (us)", [consensus], 1e6, "{:8.1f}"),
    ]
    print("\n" + "\n".join(lines))
    assert stalls and lost
