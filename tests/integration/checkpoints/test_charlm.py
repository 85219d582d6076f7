"""The character-level LM example trains, checkpoints, and resumes at another world size.

Real torchrun processes run examples/charlm.py on CPU over gloo, in a tiny
configuration, with two DataLoader worker processes per rank fed by the
elastic sampler. The first run (world size 2) stops after 3 steps; the second
(world size 1) resumes from its checkpoint and finishes. Together they must
have trained on exactly the sample stream an uninterrupted job would have
seen, and the loss must be a finite number that went down from the start.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.charlm import CharWindows, load_corpus
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[3]
GLOBAL_BATCH = 8
SEED = 5
TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--d-model",
    "32",
    "--block-size",
    "32",
    "--global-batch-size",
    str(GLOBAL_BATCH),
    "--corpus-bytes",
    "60000",
    "--num-workers",
    "2",
    "--total-steps",
    "6",
    "--every-steps",
    "2",
    "--log-every",
    "1",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "1",
    "--seed",
    str(SEED),
    "--device",
    "cpu",
]
STEP_LINE = re.compile(r"rank (\d+) world_size (\d+) step (\d+) loss ([-\d.naninf]+)")


def run_charlm(
    procs: ProcessGroupRegistry, workdir: Path, *, name: str, world_size: int, extra: list[str]
) -> tuple[dict[str, Any], str]:
    record = workdir / f"{name}.json"
    log_path = workdir / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        str(REPO / "examples" / "charlm.py"),
        "--checkpoint-dir",
        str(workdir / "ckpt"),
        "--record",
        str(record),
        *TINY,
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    proc = procs.spawn(argv, log_path=log_path, env=env, cwd=REPO)
    wait_for(lambda: proc.poll() is not None, timeout=150, what=f"torchrun {name} to finish")
    output = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{output[-4000:]}"
    return json.loads(record.read_text()), output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_charlm_resumes_at_another_world_size_with_worker_loaders_and_the_same_stream(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    first, first_log = run_charlm(
        procs, tmp_path, name="w2", world_size=2, extra=["--stop-after-step", "3"]
    )
    second, second_log = run_charlm(procs, tmp_path, name="w1", world_size=1, extra=[])

    assert (first["world_size"], first["first_step"]) == (2, 0)
    assert (second["world_size"], second["first_step"]) == (1, 3)
    assert "start at step 3 (fresh=False, saved at world size 2)" in second_log

    steps = first["steps"] + second["steps"]
    assert [s["step"] for s in steps] == list(range(6))
    # The stream an uninterrupted job would have trained on, from first principles.
    generator = torch.Generator().manual_seed(SEED)
    stream = torch.randperm(len(CharWindows(load_corpus(60000), 32)), generator=generator).tolist()
    assert [i for s in steps for i in s["samples"]] == stream[: 6 * GLOBAL_BATCH]

    losses: dict[int, list[float]] = {}
    for text, world_size in ((first_log, 2), (second_log, 1)):
        for rank, size, step, loss in STEP_LINE.findall(text):
            assert int(size) == world_size and int(rank) < world_size
            losses.setdefault(int(step), []).append(float(loss))
    assert sorted(losses) == list(range(6))
    assert all(math.isfinite(v) for values in losses.values() for v in values)
    # An untrained model scores about ln(256) = 5.5 nats per byte; training lowered it.
    assert min(losses[5]) < min(losses[0]) < 6.0
