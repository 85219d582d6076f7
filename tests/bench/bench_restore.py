"""Benchmark: where the restore of a large replicated checkpoint spends its time.

Run with
``flock /tmp/tidal-quiet.lock .venv/bin/python -m pytest tests/bench/bench_restore.py -m bench -s``
(``BENCH_RESTORE_SIZES``: examples/charlm.py model sizes, default ``100m,200m``,
where ``100m`` is ``200m`` with 8 layers instead of 16; ``BENCH_RESTORE_REPEATS``:
restores per variant and cache state, default 3).

For each size it saves the model with AdamW state (one step taken, so that
every moment exists) through the checkpoints library, as a periodic save
would (direct I/O), then restores it into a second model and optimizer again
and again, rotating between three ways:

* ``old``: the code before this benchmark, stage by stage: the file read whole
  into one ``bytes`` (``read_bytes``), its CRC-32 (``zlib.crc32``, one core),
  ``torch.load(weights_only=True)`` of a ``BytesIO`` of it, ``load_state_dict``;
* ``cpu``: the restore of a model on the CPU now: the CRC-32 checked in place
  by parallel reads (``CheckpointStore.open_verified``), ``torch.load`` of the
  file by name, ``load_state_dict``;
* ``mmap``: the restore of a model on an accelerator now, here into the CPU
  model: the same check, a memory-mapped ``torch.load``, the small tensors
  copied off the mapping, ``load_state_dict``; on the CPU the optimizer keeps
  the loaded tensors rather than copying them, so the bench copies them after
  (what the copy to a device reads), and that copy is counted in the apply stage.

Each restore runs once cold (the file dropped from the page cache with
``POSIX_FADV_DONTNEED``: a file just written with direct I/O, or read on
another machine, is not cached) and once warm. The table gives the median
and the worst of each stage, and the ratio of the median totals to ``old``'s
in the same run. Also timed: ``Checkpointer.restore()`` end to end, cold.

Peak memory stays under about 8 GB at the ``200m`` size (2.4 GB of state: the
model and optimizer, and ``old``'s two copies while it loads).
No assertion is made on time.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoints as ck
from checkpoints.restoring import copy_off_mapping
from checkpoints.state import STATE_FILE, apply_state, safe_torch_load
from checkpoints.storage import CheckpointStore
from examples.charlm import SIZES, CharLM

STAGES = ("check", "read", "torch.load", "apply")
VARIANTS = ("old", "cpu", "mmap")


def _sizes() -> list[str]:
    return os.environ.get("BENCH_RESTORE_SIZES", "100m,200m").split(",")


def _config(size: str) -> dict[str, int]:
    if size == "100m":
        return {**SIZES["200m"], "n_layer": 8}
    return dict(SIZES[size])


def _job(size: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = CharLM(**_config(size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # every exp_avg / exp_avg_sq exists, as after any real step
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Clock:
    """Stage times of one restore."""

    def __init__(self) -> None:
        self.times = dict.fromkeys(STAGES, 0.0)
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.times[stage] += now - self._last
        self._last = now


def _restore_old(store: CheckpointStore, path: Path, apply: Callable[[Any], None]) -> _Clock:
    clock = _Clock()
    manifest = store.read_manifest(path)
    data = (path / STATE_FILE).read_bytes()
    clock.mark("read")
    entry = manifest.files[STATE_FILE]
    assert (len(data), zlib.crc32(data)) == (entry.size, entry.crc32)
    clock.mark("check")
    state = safe_torch_load(data, path=path, name=STATE_FILE)
    del data
    clock.mark("torch.load")
    apply(state)
    clock.mark("apply")
    return clock


def _restore_new(
    store: CheckpointStore, path: Path, apply: Callable[[Any], None], *, mmap: bool
) -> _Clock:
    clock = _Clock()
    manifest = store.read_manifest(path)
    with store.open_verified(path, manifest, STATE_FILE) as verified:
        clock.mark("check")  # the one read of the file: checksummed in place
        state = safe_torch_load(verified, path=path, name=STATE_FILE, mmap=mmap)
        if mmap:
            state = copy_off_mapping(state)
    clock.mark("torch.load")
    apply(state)
    clock.mark("apply")
    return clock


def _applier(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, *,
             copy_optimizer: bool) -> Callable[[Any], None]:
    def apply(state: Any) -> None:
        apply_state(state, model=model, optimizer=optimizer, scheduler=None, scaler=None,
                    path=path)
        if copy_optimizer:  # what a copy to the device would read; and the mapping goes
            for moments in optimizer.state.values():
                for key, value in moments.items():
                    if isinstance(value, torch.Tensor):
                        moments[key] = value.clone()
    return apply


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_restore_of_a_large_replicated_checkpoint() -> None:
    repeats = int(os.environ.get("BENCH_RESTORE_REPEATS", "3"))
    load_before = os.getloadavg()
    rows: list[str] = []
    for size in _sizes():
        with tempfile.TemporaryDirectory(prefix="tidal-bench-restore-", dir="/tmp") as root:
            model, optimizer = _job(size, seed=0)
            params = sum(p.numel() for p in model.parameters())
            started = time.perf_counter()
            with ck.Checkpointer(root, model=model, optimizer=optimizer, async_save=False,
                                 jit_save=False, handle_sigterm=False) as ckpt:
                ckpt.save(1)
            save_s = time.perf_counter() - started
            del model, optimizer
            gc.collect()
            store = CheckpointStore(root)
            path = store.path_of(1)
            file_bytes = (path / STATE_FILE).stat().st_size
            print(f"\n{size}: {params / 1e6:.0f}M parameters + AdamW, {STATE_FILE} "
                  f"{file_bytes / 1e9:.2f} GB, saved in {save_s:.1f} s", flush=True)
            target, target_opt = _job(size, seed=1)
            results: dict[tuple[str, str], list[_Clock]] = {}
            for i in range(repeats):
                order = VARIANTS[i % 3:] + VARIANTS[: i % 3]
                for variant in order:
                    apply = _applier(target, target_opt, path, copy_optimizer=variant == "mmap")
                    for cache in ("cold", "warm"):
                        if cache == "cold":
                            _drop_cache(path / STATE_FILE)
                        gc.collect()
                        if variant == "old":
                            clock = _restore_old(store, path, apply)
                        else:
                            clock = _restore_new(store, path, apply, mmap=variant == "mmap")
                        results.setdefault((variant, cache), []).append(clock)
                        total = sum(clock.times.values())
                        print(f"  {variant:4} {cache}: {total:.2f} s", flush=True)
            end_to_end = []
            for _ in range(repeats):
                _drop_cache(path / STATE_FILE)
                gc.collect()
                started = time.perf_counter()
                with ck.Checkpointer(root, model=target, optimizer=target_opt,
                                     async_save=False, jit_save=False,
                                     handle_sigterm=False) as ckpt:
                    assert ckpt.restore().step == 1
                end_to_end.append(time.perf_counter() - started)
            del target, target_opt
            gc.collect()
        rows.append(f"| **{size}**: {file_bytes / 1e9:.2f} GB | | | | | | |")
        for cache in ("cold", "warm"):
            anchor = statistics.median(
                sum(c.times.values()) for c in results[("old", cache)]
            )
            for variant in VARIANTS:
                clocks = results[(variant, cache)]
                totals = [sum(c.times.values()) for c in clocks]
                cells = [_fmt([c.times[s] for c in clocks]) if any(
                    c.times[s] for c in clocks) else "-" for s in STAGES]
                ratio = statistics.median(totals) / anchor
                rows.append(f"| {variant}, {cache} | " + " | ".join(cells)
                            + f" | {_fmt(totals)} | {ratio:.2f} |")
        rows.append(f"| `Checkpointer.restore()`, cold (cpu) | | | | | {_fmt(end_to_end)} | |")
    print(f"\nload average before: {' '.join(f'{v:.2f}' for v in load_before)}; after: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}; median / worst of {repeats} (s)")
    print("| restore | check (CRC-32) | read | torch.load | apply (load_state_dict) | total "
          "| total / old |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
