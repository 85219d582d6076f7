"""Benchmark: what checkpointing costs a training loop (a ~25M-parameter model, Adam, CPU).

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/bench/bench_checkpoint.py -m bench -s``
(``BENCH_CHECKPOINT_PAIRS`` and ``BENCH_CHECKPOINT_BLOCK_STEPS`` set the size of
the paired comparison, below). It prints the load average before and after, and
three tables.

The first (median and worst):

* the synchronous reference: ``torch.save`` + fsync of the same state, back to
  back, each file deleted at once (the page cache reuses hot pages), and the
  same inside the training loop keeping two files (fresh pages, as in real use);
* the floor under any snapshot (one copy between buffers already faulted in),
  the snapshot alone, and a snapshot into buffers allocated on the spot;
* the training-loop stall of ``Checkpointer(async_save=True)``: first saves (a
  new checkpointer each, buffers prepared in the background) and later ones;
* the writer thread's CPU time per save (user and system), with direct I/O
  (the default) and through the page cache (``direct_io=False``), and how long
  a background save takes;
* a restore right after an async save, with either writer (a file written
  with direct I/O is not in the page cache);
* the library with checkpointing off: ``maybe_save`` per call, and the stop
  consensus with two ranks.

The second is a paired comparison that loop totals alone cannot give on a
noisy machine. Training runs in blocks of ``BLOCK_STEPS`` steps, one save per
block two steps in, and the block ends only when the save is done (waiting for
the writer counts as lost). A set is four blocks, one per mode: checkpointing
off, async with direct I/O, async through the page cache, and the synchronous
reference (keeping two files, as the checkpointers do); the order rotates from
set to set. For each mode and set, the block's figure minus the same set's
"off" block is one paired difference; the table gives their median,
interquartile range and a bootstrap 95% interval of the median, for the
measures below; the third table lists every set's wall-time differences:

* wall time of the block: the training time lost per save, everything included
  (and, within each set, sync minus async and page cache minus direct I/O);
* run-queue wait of the training threads (``/proc/self/task/*/schedstat``):
  how long they were ready to run but had no CPU, the contention the writer
  inflicts;
* CPU used outside this process (``/proc/stat`` minus ``/proc/self/stat``):
  kernel threads doing writeback for the writer, if any, and anything else
  running.

A second test (``-k overlap``) asks whether the GPU's overlap would pay on CPU
state: the snapshot's copy inline after a step against the copy in a thread
during the next forward and backward, joined in an optimizer pre-step hook, in
paired blocks of ``OVERLAP_BLOCK_STEPS`` steps (``BENCH_CHECKPOINT_PAIRS`` sets).

No assertion is made on time.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoints as ck
from checkpoints.async_save import StateSnapshot
from checkpoints.restoring import read_replicated
from checkpoints.storage import CheckpointStore

WIDTH, LAYERS, BATCH = 2048, 6, 64  # 6 x 2048^2 weights: 25.2M parameters
EVERY, FIRST_SAVES, SYNC_SAVES, COPIES, KEEP = 8, 3, 5, 10, 2
PAIRS = int(os.environ.get("BENCH_CHECKPOINT_PAIRS", "16"))
BLOCK_STEPS = int(os.environ.get("BENCH_CHECKPOINT_BLOCK_STEPS", "64"))
SAVE_AT = 2  # the save of a block comes after this many of its steps
MODES = ("off", "async, direct I/O", "async, page cache", "sync torch.save + fsync")
TICK = os.sysconf("SC_CLK_TCK")

Step = Callable[[], None]
T = TypeVar("T")


def make_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, Step]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        # Gradients kept from step to step: fresh ones would be page-faulted in at every
        # step, which on this kind of VM makes 14-step blocks vary 2-3 times as much.
        optimizer.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        optimizer.step()

    step()  # Adam's moments exist from here on
    return model, optimizer, step


def large_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def thread_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


def sync_save(state: dict[str, Any], path: Path) -> tuple[float, float, float]:
    """The reference: torch.save + fsync. Returns wall, user and system seconds."""
    cpu, started = thread_cpu(), time.perf_counter()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    wall, after = time.perf_counter() - started, thread_cpu()
    return wall, after[0] - cpu[0], after[1] - cpu[1]


def keep_newest(files: list[Path], path: Path, keep: int) -> None:
    """Add ``path`` to ``files`` (oldest first) and delete all but the newest ``keep``."""
    files.append(path)
    while len(files) > keep:
        files.pop(0).unlink()


def sync_saves(model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> list[float]:
    """Back to back, each file deleted at once: hot page-cache pages, the optimistic case."""
    out = []
    for i in range(SYNC_SAVES):
        path = root / f"sync-{i}.pt"
        out.append(sync_save(large_state(model, optimizer), path)[0])
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
        snapshot.take(large_state(model, optimizer))
        out.append(time.perf_counter() - started)
        snapshot.release()
    return out[1:]  # the first take allocates the buffers


def unprepared_snapshots(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """A first snapshot with nothing prepared: allocating, then faulting in while copying."""
    out = []
    for _ in range(3):
        tree = large_state(model, optimizer)
        started = time.perf_counter()
        StateSnapshot().take(tree)
        out.append(time.perf_counter() - started)
    return out


def first_save_stalls(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Step, root: Path
) -> list[float]:
    """A new checkpointer each time, as a new process: its buffers are prepared after step 1."""
    out = []
    for r in range(FIRST_SAVES):
        ckpt = ck.Checkpointer(
            root / f"first-{r}", model=model, optimizer=optimizer, every_steps=EVERY, keep=KEEP
        )
        for i in range(EVERY):
            step()
            ckpt.maybe_save(i + 1)
        ckpt.close()
        out.append(ckpt.saves[0].stall_seconds)
    return out


# ------------------------------------------------------------------ paired blocks


def runqueue_waits() -> dict[str, int]:
    """Nanoseconds each thread of this process has spent runnable but waiting for a CPU."""
    waits = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            waits[tid] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
    return waits


def runqueue_wait_since(before: dict[str, int]) -> float:
    """Seconds of run-queue wait since ``before``, of the threads alive then and now.

    Threads born since (the writer) are left out; so are threads that ended since
    (a writer that was still exiting), whose counters are gone.
    """
    after = runqueue_waits()
    return sum(after[tid] - wait for tid, wait in before.items() if tid in after) / 1e9


def cpu_outside() -> float:
    """CPU seconds the whole machine has used so far, minus this process's own."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (busy - int(own[11]) - int(own[12])) / TICK


@dataclasses.dataclass
class Block:
    """One block of training steps with (or, mode "off", without) one save."""

    seconds: float
    runqueue: float  # the training threads' run-queue wait
    outside: float  # CPU used outside this process
    stall: float | None = None  # how long the save call blocked the loop
    wait: float | None = None  # waiting for the writer at the end of the block
    save: ck.SaveRecord | None = None
    sync_cpu: tuple[float, float] | None = None


class Modes:
    """What each mode does at the save point and at the end of a block."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: Path
    ) -> None:
        self._model, self._optimizer, self._root = model, optimizer, root
        self._step = 0
        self._sync_files: list[Path] = []
        self.checkpointers = {
            MODES[1]: self._checkpointer("direct", direct_io=True),
            MODES[2]: self._checkpointer("buffered", direct_io=False),
        }

    def _checkpointer(self, name: str, *, direct_io: bool) -> ck.Checkpointer:
        return ck.Checkpointer(
            self._root / name,
            model=self._model,
            optimizer=self._optimizer,
            keep=KEEP,
            handle_sigterm=False,
            direct_io=direct_io,
        )

    def run(self, mode: str, step: Step) -> Block:
        waits, outside0, started = runqueue_waits(), cpu_outside(), time.perf_counter()
        stall = wait = None
        record, sync_cpu = None, None
        for i in range(BLOCK_STEPS):
            step()
            if i + 1 != SAVE_AT or mode == MODES[0]:
                continue
            self._step += 1
            if mode == MODES[3]:
                stall, user, system = self._sync_save()
                sync_cpu = (user, system)
            else:
                ckpt = self.checkpointers[mode]
                ckpt.save(self._step)
                record = ckpt.saves[-1]
                stall = record.stall_seconds
        if mode in self.checkpointers:
            before = time.perf_counter()
            self.checkpointers[mode]._saver.writer.wait()
            wait = time.perf_counter() - before
        seconds = time.perf_counter() - started
        return Block(
            seconds=seconds,
            runqueue=runqueue_wait_since(waits),
            outside=cpu_outside() - outside0,
            stall=stall,
            wait=wait,
            save=record,
            sync_cpu=sync_cpu,
        )

    def _sync_save(self) -> tuple[float, float, float]:
        """The reference inside the loop, keeping KEEP files as the checkpointers do."""
        path = self._root / f"sync-{self._step:06d}.pt"
        result = sync_save(large_state(self._model, self._optimizer), path)
        keep_newest(self._sync_files, path, KEEP)
        return result

    def close(self) -> None:
        for ckpt in self.checkpointers.values():
            ckpt.close()


def rotating_sets(run: Callable[[str], T], names: Sequence[str], pairs: int) -> list[dict[str, T]]:
    """One warm-up set (not returned), then ``pairs`` sets of one run per name, order rotating."""
    sets = []
    for index in range(pairs + 1):
        shift = index % len(names)
        sets.append({name: run(name) for name in [*names[shift:], *names[:shift]]})
    return sets[1:]


def paired_blocks(modes: Modes, step: Step) -> list[dict[str, Block]]:
    """One warm-up set (not returned), then PAIRS sets of one block per mode, order rotating."""
    return rotating_sets(lambda mode: modes.run(mode, step), MODES, PAIRS)


def restore_seconds(root: Path) -> float:
    """Verify and load the newest checkpoint under ``root``, right after it was saved."""
    store = CheckpointStore(root)
    started = time.perf_counter()
    read_replicated(store, store.path_of(store.steps()[0]), mmap=False)
    return time.perf_counter() - started


# ------------------------------------------------------------------ reporting


def loads(values: tuple[float, float, float] | None = None) -> str:
    return " ".join(f"{v:.2f}" for v in values or os.getloadavg())


def row(name: str, values: list[float], unit: float = 1.0, fmt: str = "{:8.3f}") -> str:
    med, worst = statistics.median(values) * unit, max(values) * unit
    return f"| {name:<64} | {fmt.format(med)} | {fmt.format(worst)} |"


def bootstrap_median(values: list[float], *, resamples: int = 4000) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median (seeded: the same data, the same CI)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def paired_row(name: str, values: list[float]) -> str:
    # quantiles() needs two values; the quartiles of one value are that value.
    padded = values if len(values) > 1 else values * 2
    q1, med, q3 = statistics.quantiles(padded, n=4, method="inclusive")
    low, high = bootstrap_median(values)
    return (
        f"| {name:<52} | {med:7.3f} | {q1:7.3f} .. {q3:7.3f} | {low:7.3f} .. {high:7.3f} "
        f"| {len(values):3d} |"
    )


def paired_table(sets: list[dict[str, Block]]) -> list[str]:
    """Each mode minus the same set's "off" block; then the modes against each other."""
    lines = [
        "| paired difference per save, within each set | median | interquartile range "
        "| 95% CI of median | n |",
        "|---|---|---|---|---|",
    ]
    measures: list[tuple[str, Callable[[Block], float]]] = [
        ("training time lost (s)", lambda b: b.seconds),
        ("training threads' run-queue wait (s)", lambda b: b.runqueue),
        ("CPU outside this process (s)", lambda b: b.outside),
    ]
    for label, measure in measures:
        for mode in MODES[1:]:
            diffs = [measure(s[mode]) - measure(s[MODES[0]]) for s in sets]
            lines.append(paired_row(f"{label}: {mode} - off", diffs))
    for worse, better in [(MODES[3], MODES[1]), (MODES[2], MODES[1]), (MODES[3], MODES[2])]:
        diffs = [s[worse].seconds - s[better].seconds for s in sets]
        lines.append(paired_row(f"wall time (s): {worse} - {better}", diffs))
    return lines


def mode_rows(sets: list[dict[str, Block]]) -> list[str]:
    """Per-mode single figures from the blocks: stalls, writer CPU, save durations."""
    lines = []
    for mode in MODES[1:3]:
        blocks = [s[mode] for s in sets]
        records = [b.save for b in blocks if b.save is not None]
        lines += [
            row(f"{mode}: stall, saves into reused buffers (s)", [b.stall or 0.0 for b in blocks]),
            row(f"{mode}: writer CPU, user (s)", [r.writer_user_seconds or 0.0 for r in records]),
            row(
                f"{mode}: writer CPU, system (s)",
                [r.writer_system_seconds or 0.0 for r in records],
            ),
            row(f"{mode}: background save duration (s)", [r.save_seconds or 0.0 for r in records]),
            row(f"{mode}: wait for the writer at block end (s)", [b.wait or 0.0 for b in blocks]),
        ]
    sync = [s[MODES[3]] for s in sets]
    lines += [
        row("sync in the loop, keep 2: blocks (s)", [b.stall or 0.0 for b in sync]),
        row("sync in the loop, keep 2: CPU, user (s)", [b.sync_cpu[0] for b in sync if b.sync_cpu]),
        row(
            "sync in the loop, keep 2: CPU, system (s)", [b.sync_cpu[1] for b in sync if b.sync_cpu]
        ),
        row("off: block of training steps (s)", [s[MODES[0]].seconds for s in sets]),
        row(
            "off: training threads' run-queue wait per block (s)",
            [s[MODES[0]].runqueue for s in sets],
        ),
        row(
            "off: cores used outside this process",
            [s[MODES[0]].outside / s[MODES[0]].seconds for s in sets],
        ),
    ]
    return lines


def raw_table(sets: list[dict[str, Block]]) -> list[str]:
    """Every set's wall-time differences, in run order: the data behind the medians."""
    header = " | ".join(f"{mode} - off (s)" for mode in MODES[1:])
    lines = [f"| set | off block (s) | {header} |", "|---" * (len(MODES) + 1) + "|"]
    for index, blocks in enumerate(sets, 1):
        off = blocks[MODES[0]].seconds
        diffs = " | ".join(f"{blocks[mode].seconds - off:6.3f}" for mode in MODES[1:])
        lines.append(f"| {index} | {off:6.3f} | {diffs} |")
    return lines


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_bench_checkpoint_cost(tmp_path: Path) -> None:
    load_before = os.getloadavg()
    model, optimizer, step = make_job()
    params = sum(p.numel() for p in model.parameters())
    sync = sync_saves(model, optimizer, tmp_path)
    alone = snapshot_alone(model, optimizer)
    unprepared = unprepared_snapshots(model, optimizer)
    first = first_save_stalls(model, optimizer, step, tmp_path)
    modes = Modes(model, optimizer, tmp_path)
    sets = paired_blocks(modes, step)
    modes.close()
    step_times = [s[MODES[0]].seconds / BLOCK_STEPS for s in sets]
    state_bytes = modes.checkpointers[MODES[1]]._saver.snapshot.nbytes
    restore_direct = restore_seconds(tmp_path / "direct")
    restore_buffered = restore_seconds(tmp_path / "buffered")
    floor = copy_floor(state_bytes)
    idle = ck.Checkpointer(tmp_path / "idle", model=model, optimizer=optimizer)
    started = time.perf_counter()
    for i in range(100_000):  # maybe_save alone, without the noise of steps around it
        idle.maybe_save(i)
    per_call = (time.perf_counter() - started) / 100_000
    idle.close()
    consensus = consensus_cost(tmp_path)
    median_sync = statistics.median(sync)
    later = [s[m].stall or 0.0 for s in sets for m in MODES[1:3]]
    lines = [
        f"model: {params / 1e6:.1f}M parameters + Adam, {state_bytes / 1e6:.0f} MB of state; "
        f"{torch.get_num_threads()} threads; {PAIRS} sets of {len(MODES)} blocks of "
        f"{BLOCK_STEPS} steps, one save per block after step {SAVE_AT}",
        f"load average (1, 5, 15 min) before: {loads(load_before)}, after: {loads()}",
        f"memcpy bandwidth: {state_bytes / statistics.median(floor) / 1e9:.1f} GB/s",
        "| measure | median | worst |",
        "|---|---|---|",
        row("training step, mean of an off block (s)", step_times),
        row("sync torch.save + fsync, back to back, file deleted (s)", sync),
        row("floor: one copy of the state's bytes, memory faulted in (s)", floor),
        row("snapshot alone: state_dicts + copy into reused buffers (s)", alone),
        row("snapshot into buffers allocated on the spot (s)", unprepared),
        row("async save: stall, first save of a checkpointer (s)", first),
        row(
            "async save: stall / sync save, all saves (%)",
            [s / median_sync for s in first + later],
            100,
        ),
        *mode_rows(sets),
        row("restore right after an async direct-I/O save (s)", [restore_direct]),
        row("restore right after an async page-cache save (s)", [restore_buffered]),
        row("checkpointing off: maybe_save per call (us)", [per_call], 1e6, "{:8.1f}"),
        row(
            "checkpointing off: maybe_save / step (%)",
            [per_call / statistics.median(step_times)],
            100,
            "{:8.4f}",
        ),
        row("2 ranks: maybe_save with stop consensus (us)", [consensus], 1e6, "{:8.1f}"),
        "",
        *paired_table(sets),
        "",
        *raw_table(sets),
    ]
    print("\n" + "\n".join(lines))
    assert len(sets) == PAIRS


# ------------------------------------------------------------------ overlap on CPU state

OVERLAP_MODES = ("off", "copy inline", "copy in a thread, joined before the next step")
OVERLAP_BLOCK_STEPS = 6


class CopyOverlap:
    """The snapshot's copy inline after a step, or in a thread during the next forward and
    backward, joined in an optimizer pre-step hook (what the GPU's side stream does)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model, self._optimizer = model, optimizer
        self._snapshot = StateSnapshot()
        self._pending: list[threading.Thread] = []
        self.hook = optimizer.register_step_pre_hook(self._join)
        self.inline: list[float] = []

    def _join(self, *_: Any) -> None:
        while self._pending:
            self._pending.pop().join()

    def _copy(self, tree: dict[str, Any]) -> None:
        self._snapshot.take(tree)
        self._snapshot.release()

    def run(self, mode: str, step: Step) -> float:
        started = time.perf_counter()
        for i in range(OVERLAP_BLOCK_STEPS):
            step()
            if i + 1 != SAVE_AT or mode == OVERLAP_MODES[0]:
                continue
            tree = large_state(self._model, self._optimizer)
            if mode == OVERLAP_MODES[1]:
                before = time.perf_counter()
                self._copy(tree)
                self.inline.append(time.perf_counter() - before)
            else:
                thread = threading.Thread(target=self._copy, args=(tree,))
                thread.start()
                self._pending.append(thread)
        return time.perf_counter() - started


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_bench_cpu_copy_overlap() -> None:
    """Whether overlapping the CPU snapshot's copy with the next step would pay (it was not
    added: see docs/benchmarks.md)."""
    load_before = os.getloadavg()
    model, optimizer, step = make_job()
    overlap = CopyOverlap(model, optimizer)
    overlap.run(OVERLAP_MODES[1], step)  # the buffers
    sets = rotating_sets(lambda mode: overlap.run(mode, step), OVERLAP_MODES, PAIRS)
    overlap.hook.remove()
    off, inline, thread = ([s[m] for s in sets] for m in OVERLAP_MODES)
    lines = [
        f"load average before: {loads(load_before)}, after: {loads()}; "
        f"{torch.get_num_threads()} threads; {PAIRS} sets of {OVERLAP_BLOCK_STEPS} steps",
        row("training step, mean of an off block (s)", [b / OVERLAP_BLOCK_STEPS for b in off]),
        row("the copy inline: snapshot into reused buffers (s)", overlap.inline[1:]),
        "",
        "| paired difference per save, within each set | median | interquartile range "
        "| 95% CI of median | n |",
        "|---|---|---|---|---|",
        paired_row("copy inline - off (s)", [a - b for a, b in zip(inline, off, strict=True)]),
        paired_row("copy in a thread - off (s)", [a - b for a, b in zip(thread, off, strict=True)]),
        paired_row("thread - inline (s)", [a - b for a, b in zip(thread, inline, strict=True)]),
    ]
    print("\n" + "\n".join(lines))
