"""Benchmark: recovery from a SIGKILLed node, in place (the survivors keep their processes)
beside the restart path.

Run with ``flock /tmp/tidal-quiet.lock .venv/bin/python -m pytest -m bench -s
tests/bench/bench_recovery_in_place.py``
(``BENCH_IN_PLACE_KILLS=N``: kills per path, 10 by default;
``BENCH_IN_PLACE_PATHS=in-place`` or ``restart`` runs one path only;
``BENCH_IN_PLACE_NODES=8``: the job's nodes, 3 by default;
``BENCH_IN_PLACE_DEVICE=cuda``: the model and data on the GPU, every member sharing
the machine's GPU 0 over gloo, its agents started with ``--gpus none`` so that
none hides it; ``BENCH_IN_PLACE_MODEL="--features 1024 --hidden 4096"``: a larger
MLP than the default 8 x 32, appended to the script's arguments).

One job of ``examples/mlp.py`` (float64, the checkpoints library, DDP over gloo,
a checkpoint every 20 steps, a step every 0.05 s) on ``NODES`` (3) ``tidal agent``
processes on loopback (min 1, max ``NODES`` nodes; the assignments are written
straight into etcd, as in tests/bench/bench_recovery.py). Then, ``N`` times: once
the job trains at world size ``NODES``, the newest node is SIGKILLed with its
process group (a dying machine) at an arbitrary moment of a step; once the
survivors train at world size ``NODES - 1``, a fresh node (a new agent) is
assigned and joins. The two
paths run the same script: with ``--live-resize`` the survivors recover **in
place**; without it the runner takes the **restart** path (just-in-time save,
stop, restart from the zygote, restore).

**Recovery** = from the kill to the first step a survivor completes at world size
``NODES - 1``. For the in-place path, from the survivors' own log lines (the worker that
logged the first step at 2; :func:`in_place_breakdown`):

* *detect + unblock*: kill -> the survivor's collective raised (gloo sees the dead
  peer's sockets close; the runner's lease/ring notice is not needed for this);
* *rendezvous*: -> the runner's notice of the next round came (the runner learns
  of the death from the ring and forms the round without the dead member);
* *re-form*: -> the new process group is up (``init_process_group``);
* *first step*: -> the state sync, ``on_resize`` and the repeated step are done.

No assertion is made on time; the figures are printed.
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment
from tests.support.acid import MLP
from tests.support.agents import AgentCluster, assign, nodes_in_state, unassign
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

ARGS = [
    "--total-steps", "1000000", "--global-batch-size", "10", "--dataset-size", "96",
    "--dtype", "float64", "--every-steps", "20", "--seed", "5", "--step-seconds", "0.05",
]
NODES = int(os.environ.get("BENCH_IN_PLACE_NODES", "3"))
DEVICE = os.environ.get("BENCH_IN_PLACE_DEVICE", "cpu")
MODEL = os.environ.get("BENCH_IN_PLACE_MODEL", "").split()
_STEP = re.compile(r"rank (\d+) world_size (\d+) step (\d+) loss")
_FAILED = "a collective failed at step"
_RECOVERED = re.compile(r"recovered in place .* in ([\d.]+) s \(notice ([\d.]+) s, "
                        r"re-form ([\d.]+) s, sync and on_resize ([\d.]+) s\)")


def _stamp(line: str) -> float | None:
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def _worker_logs(root: Path) -> list[Path]:
    return sorted(root.glob("*/jobs/*/gen-*/logs/**/stderr.log"))


def _lines_after(path: Path, after: float) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        stamp = _stamp(line)
        if stamp is not None and stamp > after:
            out.append((stamp, line))
    return out


@dataclass(frozen=True)
class Kill:
    """One kill: the recovery and, in place, where its time went (seconds)."""

    recovery: float
    parts: dict[str, float]


def first_step_at(root: Path, size: int, *, after: float) -> tuple[float, Path] | None:
    """The first step line at world size ``size`` after ``after``, and whose log it is."""
    found = []
    for path in _worker_logs(root):
        for stamp, line in _lines_after(path, after):
            m = _STEP.search(line)
            if m is not None and int(m.group(2)) == size:
                found.append((stamp, path))
                break
    return min(found) if found else None


def in_place_breakdown(path: Path, *, killed: float, first: float) -> dict[str, float]:
    """Detect + unblock, rendezvous, re-form, first step: from one survivor's log."""
    failed = recovered = None
    notice = reform = 0.0
    for stamp, line in _lines_after(path, killed):
        if failed is None and _FAILED in line:
            failed = stamp
        m = _RECOVERED.search(line)
        if m is not None and recovered is None:
            recovered = stamp
            notice, reform = float(m.group(2)), float(m.group(3))
    if failed is None or recovered is None:
        return {}
    return {
        "detect+unblock": failed - killed,
        "rendezvous": notice,
        "re-form": reform,
        "first step": first - (failed + notice + reform),
    }


def run_path(tmp: Path, procs: ProcessGroupRegistry, etcd: EtcdServer, root: str,
             client: EtcdClient, *, live: bool, kills: int, nodes: int = 3) -> list[Kill]:
    tmp.mkdir(parents=True, exist_ok=True)
    cluster = AgentCluster(etcd_endpoint=etcd.endpoint, etcd_root=root, workdir=tmp, procs=procs)
    job_id = "in-place" if live else "restart"
    command = [sys.executable, str(MLP), "--checkpoint-dir", str(tmp / "ckpt"), *ARGS,
               "--device", DEVICE, *MODEL]
    agent_flags = ("--gpus", "none") if DEVICE == "cuda" else ()
    if live:
        command.append("--live-resize")
    job = Assignment(job_id=job_id, command=command, env={"OMP_NUM_THREADS": "1"},
                     min_nodes=1, max_nodes=nodes, max_restarts=0, grace_period_s=10)
    prefix = "i" if live else "r"  # node ids of their own: the other path's job is not theirs
    members = [f"{prefix}{chr(ord('a') + i)}" for i in range(nodes)]
    for node in members:
        cluster.start_agent(node, extra=agent_flags)
        assign(client, node, job)
    out: list[Kill] = []
    try:  # a run that times out keeps the kills measured before (the report says how many)
        for i in range(kills):
            wait_for(lambda: nodes_in_state(client, job_id, set(members), size=nodes),
                     timeout=240, what=f"{members} at world size {nodes}")
            whole = time.time()
            wait_for(functools.partial(first_step_at, tmp, nodes, after=whole + 0.5),
                     timeout=240, what=f"steps at world size {nodes}")
            victim = members.pop()
            killed = time.time()
            cluster.kill_agent(victim)
            unassign(client, victim, job_id)
            first = wait_for(functools.partial(first_step_at, tmp, nodes - 1, after=killed),
                             timeout=240, what=f"a step at world size {nodes - 1}")
            assert first is not None
            stamp, path = first
            parts = in_place_breakdown(path, killed=killed, first=stamp) if live else {}
            out.append(Kill(stamp - killed, parts))
            print(f"{job_id} kill {i + 1}: recovery {stamp - killed:.3f} s {parts}", flush=True)
            newcomer = f"{prefix}n{i}"
            cluster.start_agent(newcomer, extra=agent_flags)
            assign(client, newcomer, job)
            members.append(newcomer)
    except TimeoutError as exc:
        print(f"{job_id}: stopped after {len(out)} kill(s): {exc}", flush=True)
    finally:
        for node in list(cluster.agents):
            procs.kill_group(cluster.agents[node])
            unassign(client, node, job_id)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def report(results: dict[str, list[Kill]]) -> str:
    lines = [f"{NODES} nodes, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
             f"device {DEVICE} {' '.join(MODEL)}".rstrip(),
             f"{'path':10} {'kills':>5} {'p50 s':>7} {'p99 s':>7} {'max s':>7}"]
    for name, kills in results.items():
        values = [k.recovery for k in kills]
        if not values:
            lines.append(f"{name:10} {0:5d} (none measured)")
            continue
        lines.append(f"{name:10} {len(values):5d} {_pct(values, 0.5):7.3f} "
                     f"{_pct(values, 0.99):7.3f} {max(values):7.3f}")
    in_place = [k.parts for k in results.get("in-place", []) if k.parts]
    if in_place:
        lines.append("in-place breakdown (median / worst, s): " + ", ".join(
            f"{part} {statistics.median(p[part] for p in in_place):.3f} / "
            f"{max(p[part] for p in in_place):.3f}" for part in in_place[0]))
    return "\n".join(lines)


@pytest.mark.bench
@pytest.mark.timeout(3600)
def test_bench_lost_node_in_place_and_restart(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    kills = int(os.environ.get("BENCH_IN_PLACE_KILLS", "10"))
    paths = os.environ.get("BENCH_IN_PLACE_PATHS", "in-place,restart").split(",")
    results: dict[str, list[Kill]] = {}
    for name in paths:
        results[name] = run_path(tmp_path / name, procs, etcd_server, etcd_root, etcd_client,
                                 live=name == "in-place", kills=kills, nodes=NODES)
    print("\n" + report(results), flush=True)
