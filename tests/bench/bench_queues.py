"""Benchmark: a simulated day of submissions from several queues, through the pure scheduler.

Run with
``.venv/bin/python -m pytest tests/bench/bench_queues.py -m bench -s``.

The cluster is the simulator's (:mod:`tests.unit.service.sim`): the real
:func:`service.scheduler.plan` every ``DT`` seconds, agents that report
running, and jobs that advance by the slots they hold (nothing for
``RESTART_S`` after each membership change: a graceful resize or a restart
from the checkpoint). Three teams' queues, guarantees adding up to the
cluster, submit a seeded random mix of rigid and elastic jobs around the clock
at about 1.3 times what the cluster can run. It prints, per queue, the
guarantee, the time the queue wanted its guarantee and held less, the jobs'
waits from submission to start (p50, p95, max), and overall the slots busy,
preemptions and shrinks. docs/benchmarks.md holds the figures (target: at
least 95% of slots busy while the guarantees are met). No assertion on time.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from service.scheduler import Policy
from tests.unit.service.sim import Sim, Work, Workload, make_job, make_node

DAY_S = 24 * 3600.0
DT = 10.0
RESTART_S = 20.0
NODES = 16
QUEUES = {"a": (8, 2.0), "b": (4, 1.0), "c": (4, 1.0)}  # name -> (guaranteed, weight)
LOAD = 1.3  # offered slot-seconds over capacity


def day_of_work(seed: int, *, seconds: float = DAY_S, nodes: int = NODES) -> list[Work]:
    """Seeded submissions from every queue: half rigid (1-4 nodes), half elastic
    (min 1-2, max 8-16); work of 10 minutes to 3 hours on 2 nodes."""
    rng = random.Random(seed)
    works: list[Work] = []
    budget = LOAD * nodes * seconds
    share = {name: g / nodes for name, (g, _) in QUEUES.items()}
    for name, part in share.items():
        offered = 0.0
        t = 0.0
        while offered < budget * part:
            size = rng.randint(1, 4)
            elastic = rng.random() < 0.5
            low, high = (rng.randint(1, 2), rng.randint(8, 16)) if elastic else (size, size)
            work = rng.uniform(600, 3 * 3600) * 2
            t += rng.expovariate(1.0) * work / (budget * part / seconds)
            if t >= seconds:
                break
            job = make_job(f"{name}{len(works)}", min_nodes=low, max_nodes=high, queue=name,
                           priority=rng.choice([0, 0, 0, 1]))
            works.append(Work(job, t, work))
            offered += work
    return works


def run_day(seed: int, *, seconds: float = DAY_S, nodes: int = NODES) -> Workload:
    sim = Sim(policy=Policy())
    sim.join(*(make_node(f"n{i:02d}") for i in range(nodes)))
    for name, (guaranteed, weight) in QUEUES.items():
        sim.set_queue(name, guaranteed, weight=weight)
    return Workload(sim, day_of_work(seed, seconds=seconds, nodes=nodes), dt=DT,
                    restart_s=RESTART_S)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.bench
def test_a_day_of_three_queues_keeps_the_slots_busy_and_the_guarantees_met() -> None:
    rows = []
    for seed in (1, 2, 3):
        workload = run_day(seed)
        started = time.perf_counter()
        stats = workload.run(DAY_S)
        took = time.perf_counter() - started
        passes = DAY_S / DT
        rows.append((seed, stats, took / passes))
    print()
    print(f"{NODES} one-slot nodes, queues (guaranteed, weight) {QUEUES}, offered load "
          f"{LOAD}x, a pass every {DT:g} s, {RESTART_S:g} s per restart, one simulated day")
    print(f"{'seed':>4} {'busy':>7} {'done':>5} {'preempt':>7} {'shrink':>6} {'plan ms':>7}  "
          "queue: short of guarantee (s) / wait p50, p95, max (min)")
    for seed, stats, per_pass in rows:
        queues = "; ".join(
            f"{q}: {stats.short_of_guarantee_s.get(q, 0.0):.0f} / "
            f"{statistics.median(stats.waits.get(q, [0.0])) / 60:.1f}, "
            f"{_pct(stats.waits.get(q, []), 0.95) / 60:.1f}, "
            f"{max(stats.waits.get(q, [0.0])) / 60:.1f}"
            for q in QUEUES
        )
        print(f"{seed:>4} {stats.utilisation:>7.1%} {stats.finished:>5} {stats.preemptions:>7} "
              f"{stats.shrinks:>6} {per_pass * 1000:>7.2f}  {queues}")
