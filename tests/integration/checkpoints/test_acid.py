"""The acid test: a job resized again and again ends exactly where an uninterrupted one does.

Real torchrun processes train examples/mlp.py in float64 with DDP over gloo.
One run goes 40 steps at world size 2 without a break. Another starts from
scratch and is stopped and restarted from its checkpoints at world sizes
2 -> 1 -> 3 -> 2. The global batch (10) is not a multiple of 3, so the
world-size-3 segment splits it unevenly (4, 3, 3); a limit of 4 samples per
pass makes the world-size-1 and -2 segments accumulate gradients over several
micro-batches; the dataset (64 samples) is small enough that batches straddle
epoch boundaries. The final parameters must match to floating-point rounding,
and the samples each step consumed (as the ranks' data loaders delivered them)
must be the same, step by step.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
TOTAL_STEPS = 40
# (world size, stop after this many completed steps)
SEGMENTS = [(2, 9), (1, 17), (3, 30), (2, TOTAL_STEPS)]
COMMON_ARGS = [
    "--total-steps",
    str(TOTAL_STEPS),
    "--global-batch-size",
    "10",
    "--max-local-batch",
    "4",
    "--dataset-size",
    "64",
    "--dtype",
    "float64",
    "--every-steps",
    "4",
    "--seed",
    "3",
]
# Different world sizes add the ranks' gradients in different groupings, so the
# runs differ by rounding only: ~1e-16 relative per step, a few 1e-15 after 40
# Adam steps. Anything lost or repeated (a sample, a step, optimizer or
# scheduler state) moves the parameters by orders of magnitude more.
ATOL = 1e-10


def run_mlp(
    procs: ProcessGroupRegistry,
    workdir: Path,
    *,
    name: str,
    world_size: int,
    checkpoint_dir: Path,
    extra: list[str],
) -> dict[str, Any]:
    """Run examples/mlp.py under torchrun to completion; return its record."""
    record = workdir / f"{name}.json"
    log_path = workdir / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        str(REPO / "examples" / "mlp.py"),
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--record",
        str(record),
        *COMMON_ARGS,
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = procs.spawn(argv, log_path=log_path, env=env, cwd=REPO)
    wait_for(lambda: proc.poll() is not None, timeout=120, what=f"torchrun {name} to finish")
    output = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{output[-4000:]}"
    result: dict[str, Any] = json.loads(record.read_text())
    result["log"] = output
    return result


def params_of(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        name: torch.tensor(p["values"], dtype=torch.float64).reshape(p["shape"])
        for name, p in record["params"].items()
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_job_resized_2_1_3_2_ends_with_the_parameters_and_samples_of_an_uninterrupted_run(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    straight = run_mlp(
        procs,
        tmp_path,
        name="uninterrupted",
        world_size=2,
        checkpoint_dir=tmp_path / "ckpt-uninterrupted",
        extra=[],
    )
    assert straight["first_step"] == 0
    assert [s["step"] for s in straight["steps"]] == list(range(TOTAL_STEPS))

    segments: list[dict[str, Any]] = []
    for index, (world_size, stop) in enumerate(SEGMENTS):
        segment = run_mlp(
            procs,
            tmp_path,
            name=f"segment-{index}-w{world_size}",
            world_size=world_size,
            checkpoint_dir=tmp_path / "ckpt-elastic",
            extra=["--stop-after-step", str(stop)],
        )
        start = SEGMENTS[index - 1][1] if index else 0
        # Each segment ran at its own world size and resumed exactly where the last one stopped.
        assert segment["world_size"] == world_size
        assert segment["first_step"] == start
        assert [s["step"] for s in segment["steps"]] == list(range(start, stop))
        for rank in range(world_size):
            assert f"rank {rank} world_size {world_size} step {start} " in segment["log"]
        segments.append(segment)

    elastic_steps = [step for segment in segments for step in segment["steps"]]
    assert elastic_steps == straight["steps"]  # same samples, step by step, in the same order
    consumed = collections.Counter(i for s in elastic_steps for i in s["samples"])
    assert consumed == collections.Counter(i for s in straight["steps"] for i in s["samples"])
    assert sum(consumed.values()) == TOTAL_STEPS * 10

    final, expected = params_of(segments[-1]), params_of(straight)
    diff = max((final[k] - expected[k]).abs().max().item() for k in expected)
    log.info("acid test: max abs parameter difference %.3g (tolerance %g)", diff, ATOL)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=ATOL, rtol=0)
    # The comparison means something: the last 31 steps moved the parameters far
    # beyond the tolerance.
    early = params_of(segments[0])
    moved = max((expected[k] - early[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, moved
