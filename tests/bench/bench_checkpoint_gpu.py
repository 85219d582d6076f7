"""Benchmark: how long a checkpoint of GPU state holds the training loop up (needs CUDA).

Run on a GPU machine with
``.venv/bin/python -m pytest tests/bench/bench_checkpoint_gpu.py -m bench -s``
(``BENCH_GPU_PAIRS``, ``BENCH_GPU_BLOCK_STEPS`` and ``BENCH_GPU_BATCH`` set the
size of the run; skipped where torch sees no GPU). The model is
examples/charlm.py's ``--size 200m`` (203M float32 parameters, bf16 autocast)
with AdamW: 2.4 GB of model and optimizer state.

Training runs in blocks of ``BLOCK_STEPS`` steps, one save per block two
steps in; a block is timed from a device synchronize before its first step to
one after its last, and a background save still writing then is waited for
outside the block (its CPU and disk work during the block count). A set is one
block per mode, the order rotating from set to set, after a warm-up set that
also allocates the pinned buffers. Per mode, the block minus the same set's
block without a save is the training time lost per save; the table gives its
median, interquartile range and bootstrap 95% interval, in seconds and in
steps of the step time, and its ratio to the synchronous anchor:

* ``sync torch.save + fsync``: the anchor (the state copied to the host and
  written while the loop waits; two files kept, as the checkpointers do);
* ``async, copy waited for``: ``Checkpointer`` as it was before the side
  stream: the snapshot's device-to-host copy on the training stream, waited for;
* ``async, side stream``: ``Checkpointer`` (the default on a GPU): the copy on a
  side stream, the next optimizer step ordered after it on the device;
* ``async, side stream, staged``: the same with ``stage_on_device`` (the state
  cloned on the device first; the step never waits for the transfer).

No assertion is made on time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import checkpoints as ck
from checkpoints.async_save import StateSnapshot
from examples.charlm import SIZES, VOCAB, CharLM
from tests.bench.bench_checkpoint import (
    bootstrap_median,
    keep_newest,
    loads,
    rotating_sets,
    sync_save,
)

PAIRS = int(os.environ.get("BENCH_GPU_PAIRS", "8"))
BLOCK_STEPS = int(os.environ.get("BENCH_GPU_BLOCK_STEPS", "24"))
BATCH = int(os.environ.get("BENCH_GPU_BATCH", "16"))  # windows of 512 bytes per step
SAVE_AT, KEEP = 2, 2
OFF, SYNC = "off", "sync torch.save + fsync"
WAITED, SIDE, STAGED = "async, copy waited for", "async, side stream", "async, side stream, staged"
MODES = (OFF, SYNC, WAITED, SIDE, STAGED)

Step = Callable[[], None]


def make_job(
    device: torch.device, size: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Step]:
    """charlm at ``size`` with AdamW, a fixed batch, bf16 autocast on a GPU; warmed up."""
    torch.manual_seed(0)
    config = SIZES[size]
    model = CharLM(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    x = torch.randint(0, VOCAB, (BATCH, config["block_size"]), device=device)
    y = torch.randint(0, VOCAB, (BATCH, config["block_size"]), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        optimizer.step()

    for _ in range(3):  # Adam's moments exist from the first step on
        step()
    synchronize(device)
    return model, optimizer, step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Block:
    seconds: float
    call: float | None = None  # how long the save call itself took
    wait: float | None = None  # a background save waited for after the block
    save: ck.SaveRecord | None = None


class Modes:
    """A checkpointer per asynchronous mode; the synchronous anchor's files."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        root: Path,
        device: torch.device,
    ) -> None:
        self._model, self._optimizer, self._root, self._device = model, optimizer, root, device
        self._saves = 0
        self._sync_files: list[Path] = []
        self.checkpointers = {mode: self._checkpointer(mode) for mode in (WAITED, SIDE, STAGED)}

    def _checkpointer(self, mode: str) -> ck.Checkpointer:
        ckpt = ck.Checkpointer(
            self._root / mode.replace(" ", "-").replace(",", ""),
            model=self._model,
            optimizer=self._optimizer,
            keep=KEEP,
            handle_sigterm=False,
            jit_save=False,
        )
        if mode == WAITED:  # no optimizer to order the step: the copy is waited for
            ckpt._saver.snapshot = StateSnapshot()
        elif mode == STAGED:
            ckpt._saver.snapshot = StateSnapshot(
                model=self._model, optimizer=self._optimizer, stage_on_device=True
            )
        return ckpt

    def run(self, mode: str, step: Step) -> Block:
        synchronize(self._device)
        started = time.perf_counter()
        call = None
        for i in range(BLOCK_STEPS):
            step()
            if i + 1 != SAVE_AT or mode == OFF:
                continue
            self._saves += 1
            before = time.perf_counter()
            if mode == SYNC:
                self._sync_save()
            else:
                self.checkpointers[mode].save(self._saves)
            call = time.perf_counter() - before
        synchronize(self._device)
        block = Block(seconds=time.perf_counter() - started, call=call)
        if mode in self.checkpointers:
            ckpt = self.checkpointers[mode]
            before = time.perf_counter()
            ckpt._saver.writer.wait()
            block.wait, block.save = time.perf_counter() - before, ckpt.saves[-1]
        return block

    def _sync_save(self) -> None:
        path = self._root / f"sync-{self._saves:06d}.pt"
        state = {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict()}
        sync_save(state, path)
        keep_newest(self._sync_files, path, KEEP)

    def close(self) -> None:
        for ckpt in self.checkpointers.values():
            ckpt.close()


def lost_row(name: str, lost: list[float], step_time: float, anchor: float) -> str:
    padded = lost if len(lost) > 1 else lost * 2
    q1, med, q3 = statistics.quantiles(padded, n=4, method="inclusive")
    low, high = bootstrap_median(lost)
    return (
        f"| {name:<28} | {med:7.3f} | {q1:7.3f} .. {q3:7.3f} | {low:7.3f} .. {high:7.3f} "
        f"| {med / step_time:7.1f} | {med / anchor:6.3f} |"
    )


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({max(values):.3f})" if values else "-"


def report(sets: list[dict[str, Block]], *, params: int, state_bytes: int, name: str) -> list[str]:
    step_time = statistics.median(s[OFF].seconds for s in sets) / BLOCK_STEPS
    lost = {m: [s[m].seconds - s[OFF].seconds for s in sets] for m in MODES[1:]}
    anchor = statistics.median(lost[SYNC])
    lines = [
        f"{name}: {params / 1e6:.0f}M parameters + AdamW, {state_bytes / 1e9:.2f} GB of state; "
        f"{PAIRS} sets of {len(MODES)} blocks of {BLOCK_STEPS} steps (batch {BATCH}), "
        f"one save per block after step {SAVE_AT}",
        f"load average (1, 5, 15 min): {loads()}",
        f"step time (median of the blocks without a save): {step_time * 1e3:.1f} ms",
        "",
        "| training time lost per save | median (s) | interquartile range | 95% CI of median "
        "| steps | / sync |",
        "|---|---|---|---|---|---|",
        *(lost_row(mode, lost[mode], step_time, anchor) for mode in MODES[1:]),
        "",
        "| per save, median (worst) | save call (s) | background save (s) | waited for after "
        "the block (s) |",
        "|---|---|---|---|",
    ]
    for mode in MODES[1:]:
        blocks = [s[mode] for s in sets]
        calls = [b.call or 0.0 for b in blocks]
        saves = [b.save.save_seconds or 0.0 for b in blocks if b.save is not None]
        waits = [b.wait or 0.0 for b in blocks if b.wait is not None]
        lines.append(f"| {mode} | {cell(calls)} | {cell(saves)} | {cell(waits)} |")
    return lines


def run_benchmark(root: Path, device: torch.device, size: str) -> list[str]:
    """The whole benchmark on ``device``: the lines of its report."""
    model, optimizer, step = make_job(device, size)
    params = sum(p.numel() for p in model.parameters())
    modes = Modes(model, optimizer, root, device)
    try:
        sets = rotating_sets(lambda mode: modes.run(mode, step), MODES, PAIRS)
    finally:
        modes.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    state_bytes = modes.checkpointers[SIDE]._saver.snapshot.nbytes
    return report(sets, params=params, state_bytes=state_bytes, name=name)


@pytest.mark.bench
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(1800)
def test_bench_checkpoint_stall_on_a_gpu(tmp_path: Path) -> None:
    lines = run_benchmark(tmp_path, torch.device("cuda", torch.cuda.current_device()), "200m")
    print("\n" + "\n".join(lines))


def _smoke() -> None:
    """``python -m tests.bench.bench_checkpoint_gpu``: the small model on the CPU (the code, not
    the figures: with BENCH_GPU_PAIRS=1 BENCH_GPU_BLOCK_STEPS=4 BENCH_GPU_BATCH=2, seconds)."""
    with tempfile.TemporaryDirectory() as root:
        print("\n".join(run_benchmark(Path(root), torch.device("cpu"), "small")))


if __name__ == "__main__":
    _smoke()
