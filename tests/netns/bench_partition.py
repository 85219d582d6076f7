"""Benchmark: recovery from a network partition across hosts (network namespaces).

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/netns/bench_partition.py -m bench -s``
(``BENCH_PARTITION_REPEATS=N``, 5 by default). Needs root and iproute2.

One cluster (three etcd hosts, a coordinator host, three agent hosts), one job
of examples/elastic_ddp.py (DDP over gloo between the hosts, a checkpoint file
per node after every step, one step every 0.1 s) with min 1 and max 3 nodes.
Each repetition:

1. the job trains at world size 3;
2. one agent host is cut off (its link goes down; no process dies): the
   host of rank 0 in even repetitions, another one in odd ones;
   **recovery** = from the cut to the first step completed at world size 2,
   from the workers' step events; **detected** = from the cut to the first
   survivor runner's "peer(s) ... lost" line; **workers started** = from
   the cut to the first new rank log of a survivor; **API** = from the cut
   to ``GET /v1/jobs/{id}`` showing RUNNING at world size 2;
   **steps lost** = the last step before the cut minus the step the survivors
   resumed from;
3. the link comes back; **rejoin** = from the heal to the first step at world
   size 3.

It prints the machine's load and a table (median and worst). No assertion is
made on time.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.netns.cluster import NetnsCluster, last_step, wait_first_step_at, wait_steps
from tests.support.wait import wait_for

REPEATS = int(os.environ.get("BENCH_PARTITION_REPEATS", "5"))
HEARTBEAT_LINE = "lost (lost): restarting without them"


def _log_time(line: str) -> float | None:
    """Epoch seconds of a tidal log line (``2026-11-23 01:51:41,101 ...``), local time."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def _detected(cluster: NetnsCluster, survivors: list[str], after: float) -> float | None:
    times = []
    for node in survivors:
        for path in (cluster.workdir / "agents" / node).rglob("runner.log"):
            for line in path.read_text(errors="replace").splitlines():
                stamp = _log_time(line)
                if HEARTBEAT_LINE in line and stamp is not None and stamp > after:
                    times.append(stamp)
    return min(times) if times else None


def _workers_started(cluster: NetnsCluster, survivors: list[str], after: float) -> float | None:
    """When the first survivor's new worker started: its rank log directory's birth."""
    times = []
    for node in survivors:
        for path in (cluster.workdir / "agents" / node).rglob("attempt_*"):
            stamp = path.stat().st_mtime
            if stamp > after:
                times.append(stamp)
    return min(times) if times else None


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):6.1f} {max(values):6.1f}"


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.timeout(300 + 180 * REPEATS)
def test_bench_partition_recovery(cluster: NetnsCluster) -> None:
    api = cluster.api
    job_id = api.submit(cluster.elastic_ddp_spec("bench"))
    events = cluster.events_path("bench")
    rows: list[dict[str, float | str | None]] = []
    for rep in range(REPEATS):
        wait_for(lambda: api.running_at(job_id, 3), timeout=120, interval=0.3,
                 what="RUNNING at world size 3")
        wait_steps(events, 10, timeout=60)
        ranks = {n["node_id"]: n["ranks"] for n in api.job(job_id)["nodes"]}
        victim = next(n for n, r in ranks.items() if (0 in r) == (rep % 2 == 0))
        survivors = sorted(n for n in ranks if n != victim)
        host = cluster.agent_hosts[victim]
        before = last_step(events)
        cut_at = time.time()
        cluster.net.cut(host)
        api_at = wait_for(lambda: api.running_at(job_id, 2) and time.time(), timeout=120,
                          interval=0.2, what="RUNNING at world size 2")
        first = wait_first_step_at(events, 2, after=cut_at, timeout=60,
                                   what="a step at world size 2")
        wait_steps(events, 10, timeout=60)
        detected = _detected(cluster, survivors, cut_at)
        started = _workers_started(cluster, survivors, cut_at)
        healed_at = time.time()
        cluster.net.heal(host)
        back = wait_first_step_at(events, 3, after=healed_at, timeout=120,
                                  what="a step at world size 3 after the heal")
        rows.append({
            "victim": "rank 0" if rep % 2 == 0 else "other",
            "recovery": first["time"] - cut_at,
            "detected": None if detected is None else detected - cut_at,
            "started": None if started is None else started - cut_at,
            "api": api_at - cut_at,
            "lost": before - (first["step"] - 1),
            "rejoin": back["time"] - healed_at,
        })
        print(f"rep {rep}: {rows[-1]}")

    def column(key: str, victim: str | None = None) -> list[float]:
        return [float(r[key]) for r in rows  # type: ignore[arg-type]
                if r[key] is not None and (victim is None or r["victim"] == victim)]

    print(f"\nload average: {os.getloadavg()}, {os.cpu_count()} CPUs, {REPEATS} repetitions")
    print(f"{'measure (s)':46} median  worst")
    for key, label in (("recovery", "cut -> first step at world size 2"),
                       ("detected", "cut -> survivors notice (heartbeats stop)"),
                       ("started", "cut -> new workers started"),
                       ("api", "cut -> API: RUNNING at world size 2"),
                       ("rejoin", "heal -> first step at world size 3"),
                       ("lost", "steps lost")):
        print(f"{label:46} {_summary(column(key))}")
    for victim in ("rank 0", "other"):
        print(f"{'recovery, cut host held ' + victim:46} {_summary(column('recovery', victim))}")
    assert Path(events).exists()
