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

:func:`test_a_throttled_node_under_each_policy` is the other half: the end-to-end
scenario of tests/e2e/test_stragglers.py (a real coordinator, four real agents,
the compute-bound mlp on a, b and c, d spare) once per policy, ``off``, ``report``
and ``evict``, in one run. In each, c is throttled to about a third of its speed
after the job has trained ``WINDOW + 10`` steps at world size 3; the table gives
the job's steps per second before the throttle and in each ``PHASE_S`` seconds
after it (so a job under ``evict`` shows the dip and the recovery), how many
throttled steps the eviction took and how long, and the events seen. Run it with
``flock /tmp/tidal-quiet.lock``: a step time on a shared machine is mostly the
neighbours'.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from checkpoints.pace import PaceMeter
from rendezvous.etcd.server import EtcdServer
from tests.e2e.test_live_resize import job_events, running_at
from tests.e2e.test_stragglers import ARGS, WINDOW, Throttle, rank0_steps, worker_pids
from tests.support.acid import MLP
from tests.support.agents import warm_runner_ready
from tests.support.coordinator import coordinator_and_agents, job_view
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

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


#: Seconds of each phase after the throttle starts, and how many phases.
PHASE_S = float(os.environ.get("BENCH_STRAGGLERS_PHASE_S", "15"))
PHASES = int(os.environ.get("BENCH_STRAGGLERS_PHASES", "4"))


def _steps_per_second(root: Path, start: float, end: float) -> float:
    times = [s.time for s in rank0_steps(root) if start <= s.time < end]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else 0.0


@dataclass
class Outcome:
    before: float  # steps per second before the throttle
    rates: list[float]  # in each phase after it
    events: list[str]
    detected_s: float | None  # from the throttle to the eviction event
    detected_steps: int | None  # throttled steps until then


def _run_policy(mode: str, root: Path, etcd_server: EtcdServer, etcd_root: str,
                procs: ProcessGroupRegistry) -> Outcome:
    """One scenario under ``mode``: its rates, the eviction's cost, the events."""
    root.mkdir()
    with coordinator_and_agents(tmp_path=root, etcd_server=etcd_server, etcd_root=etcd_root,
                                procs=procs) as (coordinator, agents):
        api: httpx.Client = coordinator.client()
        for node in "abcd":
            agents.start_agent(node)
        wait_for(lambda: len(api.get("/v1/nodes").json()) == 4, timeout=60,
                 what="four nodes registered")
        wait_for(lambda: all(warm_runner_ready(root / n) for n in "abcd"), timeout=240,
                 what="every warm runner ready")
        response = api.post("/v1/jobs", json={
            "name": f"stragglers-{mode}",
            "command": [sys.executable, str(MLP), "--checkpoint-dir", str(root / "ckpt"),
                        *ARGS, "--live-resize"],
            "env": {"OMP_NUM_THREADS": "1"}, "min_nodes": 2, "max_nodes": 3,
            "grace_period_s": 20,
            "straggler_policy": {"mode": mode, "factor": 1.3, "window_steps": WINDOW},
        })
        response.raise_for_status()
        job_id = response.json()["job_id"]
        wait_for(lambda: running_at(api, job_id, {"a", "b", "c"}), timeout=120,
                 what="the job running on a, b and c")
        # Their next warm runners import torch beside the job, and their zygotes go on
        # importing (torch.optim, torch._dynamo, ...) after they say ready: the job's
        # own pace is taken over the last WINDOW of 3 * WINDOW steps after that.
        wait_for(lambda: all(warm_runner_ready(root / n) for n in "abc"), timeout=120,
                 what="a's, b's and c's new warm runners ready")
        ready = time.time()
        started = wait_for(lambda: (s := rank0_steps(root, size=3, after=ready))[3 * WINDOW:]
                           and s, timeout=240, what="steps at world size 3")[2 * WINDOW].time
        pids = wait_for(lambda: worker_pids(root / "c", job_id), timeout=10,
                        what="c's workers")
        throttled_at = time.time()
        first_slow = rank0_steps(root)[-1].step + 1
        before = _steps_per_second(root, started, throttled_at)
        throttle = Throttle(pids).start()
        evicted: tuple[float, int] | None = None
        try:
            end = throttled_at + PHASES * PHASE_S
            while time.time() < end:
                if evicted is None and any(e["reason"] == "straggler_evicted"
                                           for e in job_events(api, job_id)):
                    evicted = (time.time() - throttled_at, rank0_steps(root)[-1].step)
                time.sleep(0.2)  # a poll of the API at a fixed rate, not a synchronisation
        finally:
            throttle.stop()
        rates = [_steps_per_second(root, throttled_at + i * PHASE_S,
                                   throttled_at + (i + 1) * PHASE_S) for i in range(PHASES)]
        reasons = sorted({e["reason"] for e in job_events(api, job_id)}
                         & {"straggler_evicted", "straggler_reported", "resized_live",
                            "resized_by_restart"})
        api.post(f"/v1/jobs/{job_id}/cancel")
        wait_for(lambda: job_view(api, job_id)["phase"] == "CANCELLED", timeout=120,
                 what="the job cancelled")
    return Outcome(before=before, rates=rates, events=reasons,
                   detected_s=None if evicted is None else evicted[0],
                   detected_steps=None if evicted is None else evicted[1] - first_slow + 1)


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_a_throttled_node_under_each_policy(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry,
) -> None:
    print(f"\nload average before: {os.getloadavg()}")
    results = {mode: _run_policy(mode, tmp_path / mode, etcd_server, f"{etcd_root}-{mode}",
                                 procs)
               for mode in ("off", "report", "evict")}
    phases = " ".join(f"{f'{i * PHASE_S:.0f}-{(i + 1) * PHASE_S:.0f} s':>13}"
                      for i in range(PHASES))
    print("rank 0's steps per second before c's throttle and in each phase after it "
          "(x before)")
    print(f"{'policy':8} {'before':>7} {phases} {'detected':>15}  events")
    for mode, r in results.items():
        rates = " ".join(f"{rate:5.2f} ({rate / r.before:.2f}x)".rjust(13) for rate in r.rates)
        detected = ("-" if r.detected_s is None
                    else f"{r.detected_steps} st, {r.detected_s:.1f} s")
        print(f"{mode:8} {r.before:7.2f} {rates} {detected:>15}  {', '.join(r.events)}")
    print(f"load average after: {os.getloadavg()}")
    # The figures go to docs/benchmarks.md; what must hold whatever the load:
    assert results["off"].events == [] and results["off"].detected_s is None
    assert "straggler_reported" in results["report"].events
    assert results["report"].detected_s is None
    assert "straggler_evicted" in results["evict"].events
