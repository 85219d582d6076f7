"""Benchmark: what checkpointing costs a training loop (a ~25M-parameter model, Adam, CPU).

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/bench/bench_checkpoint.py -m bench -s``.
It prints the load average before and after, and a table (median and worst) of:

* the synchronous reference: ``torch.save`` + fsync of the same state;
* the floor under any snapshot: one copy of the state's bytes between two
  buffers already faulted in (this machine's memcpy bandwidth), and the
  snapshot alone (state_dicts + copy into reused buffers, nothing else running);
* a snapshot into buffers allocated on the spot (the copy page-faults them in):
  what a first save costs when nothing prepared its buffers;
* the training-loop stall per save of ``Checkpointer(async_save=True)``: its
  first save (each round builds a new checkpointer, as a new process does; the
  buffers were prepared in the background after the first step) and later ones
  (into the same buffers; one more save after each round, outside the timing,
  supplies one when the writer was still busy when the round ended);
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
from checkpoints.async_save import StateSnapshot

WIDTH, LAYERS, BATCH = 2048, 6, 64  # 6 x 2048^2 weights: 25.2M parameters
STEPS, EVERY, ROUNDS, SYNC_SAVES, COPIES = 48, 8, 5, 5, 10


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


def copy_floor(nbytes: int) -> list[float]:
    """One copy of ``nbytes`` between two buffers already faulted in: no snapshot is faster."""
    source = torch.ones(nbytes // 4)
    target = torch.zeros_like(source)
    out = []
    for _ in range(COPIES):
        started = time.perf_counter()
        target.copy_(source)
        out.append(time.perf_counter() - started)
    return out


def snapshot_alone(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """state_dicts + copy into the snapshot's reused buffers, with nothing else running."""
    snapshot = StateSnapshot()
    out = []
    for _ in range(COPIES + 1):
        started = time.perf_counter()
        snapshot.take({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        out.append(time.perf_counter() - started)
        snapshot.release()
    return out[1:]  # the first take allocates the buffers


def unprepared_snapshots(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """A first snapshot with nothing prepared: allocating, then faulting in while copying."""
    out = []
    for _ in range(3):
        tree = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        started = time.perf_counter()
        StateSnapshot().take(tree)
        out.append(time.perf_counter() - started)
    return out


def loads(values: tuple[float, float, float] | None = None) -> str:
    return " ".join(f"{v:.2f}" for v in values or os.getloadavg())


def row(name: str, values: list[float], unit: float = 1.0, fmt: str = "{:8.3f}") -> str:
    med, worst = statistics.median(values) * unit, max(values) * unit
    return f"| {name:<60} | {fmt.format(med)} | {fmt.format(worst)} |"


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_bench_checkpoint_stall_and_overhead(tmp_path: Path) -> None:
    load_before = os.getloadavg()
    model, optimizer, step = make_job()
    params = sum(p.numel() for p in model.parameters())
    sync = sync_saves(model, optimizer, tmp_path)
    alone = snapshot_alone(model, optimizer)
    unprepared = unprepared_snapshots(model, optimizer)
    first_stalls: list[float] = []
    later_stalls: list[float] = []
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
        on._writer.wait()
        done = [s for s in on.saves if s.save_seconds is not None]
        # The writer is rarely done before the round ends, so one more save, untimed
        # (not in the time lost), for the stall of a save into reused buffers.
        on.save(STEPS + 1)
        on.close()
        state_bytes = on._snapshot.nbytes + on._small_snapshot.nbytes
        first_stalls += [s.stall_seconds for s in done[:1]]
        later_stalls += [s.stall_seconds for s in list(on.saves)[1:]]
        save_durations += [s.save_seconds for s in done if s.save_seconds is not None]
        lost.append((sum(with_saves) - sum(with_off)) / max(len(done), 1))
        off_overhead.append(sum(with_off) / sum(plain) - 1.0)
        step_times += plain
    floor = copy_floor(state_bytes)
    # The overhead of maybe_save alone, without timing noise from the steps around it.
    idle = ck.Checkpointer(tmp_path / "idle", model=model, optimizer=optimizer)
    started = time.perf_counter()
    for i in range(100_000):
        idle.maybe_save(i)
    per_call = (time.perf_counter() - started) / 100_000
    idle.close()
    consensus = consensus_cost(tmp_path)
    median = statistics.median
    median_step, median_sync = median(step_times), median(sync)
    stalls = first_stalls + later_stalls
    lines = [
        f"model: {params / 1e6:.1f}M parameters + Adam, {state_bytes / 1e6:.0f} MB of state; "
        f"{torch.get_num_threads()} threads; saves every {EVERY} of {STEPS} steps, {ROUNDS} rounds",
        f"load average (1, 5, 15 min) before: {loads(load_before)}, after: {loads()}",
        f"memcpy bandwidth: {state_bytes / median(floor) / 1e9:.1f} GB/s",
        "| measure | median | worst |",
        "|---|---|---|",
        row("training step (s)", step_times),
        row("sync torch.save + fsync, blocks (s)", sync),
        row("floor: one copy of the state's bytes, memory faulted in (s)", floor),
        row("snapshot alone: state_dicts + copy into reused buffers (s)", alone),
        row("snapshot into buffers allocated on the spot (s)", unprepared),
        row("async save: stall, first save of a checkpointer (s)", first_stalls),
        row("async save: stall, later saves (s)", later_stalls),
        row("async save: stall, all saves (s)", stalls),
        row("async save: stall / sync save, all saves (%)", [s / median_sync for s in stalls], 100),
        row("async save: time lost per save, stall included (s)", lost),
        row("async save: background save duration (s)", save_durations),
        row("checkpointing off: step-time overhead, loop (%)", off_overhead, 100),
        row("checkpointing off: maybe_save per call (us)", [per_call], 1e6, "{:8.1f}"),
        row("checkpointing off: maybe_save / step (%)", [per_call / median_step], 100, "{:8.4f}"),
        row("2 ranks: maybe_save with stop consensus (us)", [consensus], 1e6, "{:8.1f}"),
    ]
    print("\n" + "\n".join(lines))
    assert stalls and lost
