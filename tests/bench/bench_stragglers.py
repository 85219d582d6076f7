"""Benchmark: what the straggler measure costs a step (checkpoints.pace.PaceMeter, #27).

Run with
``.venv/bin/python -m pytest tests/bench/bench_stragglers.py -m bench -s``.

Each model trains (forward, backward, SGD step, one thread) in blocks of
``BLOCK`` steps, alternately without and with a :class:`PaceMeter` on it (its
hooks registered, ``boundary`` called each step, as the Checkpointer does); the
order alternates from pair to pair, so that a noisy machine's drift falls on
both. The table gives, per model, the median step time without the meter, and
the median of the pairs' differences per step, in microseconds and as a share
of the step, all in the training thread's CPU time. The hooks cost one clock
read per parameter tensor and step: the worst case is a model of many small
tensors and little compute.

Not measured here (see docs/benchmarks.md): a job's throughput over time with a
throttled node under the off / report / evict policies side by side.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from checkpoints.pace import PaceMeter

BLOCK = int(os.environ.get("BENCH_STRAGGLERS_BLOCK", "20"))
PAIRS = int(os.environ.get("BENCH_STRAGGLERS_PAIRS", "15"))


def mlp(features: int, hidden: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = [torch.nn.Linear(features, hidden), torch.nn.Tanh()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))


def block(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          meter: PaceMeter | None, first: int) -> float:
    """CPU seconds of this thread per step over ``BLOCK`` steps (CPU time, not wall
    time: on a shared machine the wall time mostly measures the neighbours)."""
    start = time.thread_time()
    for step in range(first, first + BLOCK):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if meter is not None:
            meter.boundary(step)
    return (time.thread_time() - start) / BLOCK


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_what_the_pace_meter_costs_a_step() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = {
        # the e2e test's compute-bound mlp (tests/e2e/test_stragglers.py): 2 x 1024 wide
        "mlp 512-1024x2, batch 32": (mlp(512, 1024, 2), torch.randn(32, 512)),
        # many small tensors, little compute: the hooks' worst case
        "mlp 64-64x40, batch 8": (mlp(64, 64, 40), torch.randn(8, 64)),
    }
    print(f"\nload average before: {os.getloadavg()}")
    print(f"{'model':28} {'tensors':>8} {'step ms':>9} {'overhead us':>12} {'share %':>8}")
    shares = {}
    for name, (model, x) in cases.items():
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        block(model, opt, x, None, 0)  # warm up
        plain, diffs = [], []
        step = 0
        for pair in range(PAIRS):
            order = (False, True) if pair % 2 == 0 else (True, False)
            got = {}
            for on in order:
                meter = PaceMeter(model) if on else None  # no hooks at all in the off block
                got[on] = block(model, opt, x, meter, step)
                if meter is not None:
                    meter.close()
                step += BLOCK
            plain.append(got[False])
            diffs.append(got[True] - got[False])
        step_s = statistics.median(plain)
        over = statistics.median(diffs)
        shares[name] = over / step_s
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        print(f"{name:28} {tensors:8d} {step_s * 1e3:9.2f} {over * 1e6:12.1f} "
              f"{100 * over / step_s:8.2f}")
    print(f"load average after: {os.getloadavg()}")
    # No assertion on the share: on a loaded machine the pairs' noise (a few %) is
    # larger than the effect; docs/benchmarks.md gives the figures and the load.
