"""Benchmark: recovery from a lost node and scale-up on a new one, tidal against torchrun;
planned resizes (join, drain, PATCH) on the live path against the restart path.

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/bench/bench_recovery.py -m bench -s``
(``BENCH_RECOVERY_REPEATS=N`` to change the number of repetitions, 3 by
default; ``BENCH_RECOVERY_SYSTEMS=tidal,c10d-tuned`` to run only some systems).

One job of ``examples/elastic_ddp.py`` (DDP over gloo, a checkpoint file per
node written after every step, one step every 0.1 s, one JSON line per step
and rank) on three "nodes" on loopback, with min 1 and max 3 nodes. Each
repetition, for each system:

1. nodes ``a``, ``b``, ``c`` start together and train at world size 3;
2. node ``c`` is SIGKILLed as a dying machine would be (every process of it);
   **recovery** = from the kill to the first completed step at world size 2;
   **steps lost** = the last step completed before the kill minus the step
   the survivors resumed from;
3. node ``d`` starts; **scale-up** = from its start to the first completed
   step at world size 3;
4. tidal only: node ``e``, whose agent started with ``a``, ``b``, ``c`` but
   was not assigned the job (so its warm runner has imported torch), is
   assigned it; **warm scale-up** = from the assignment to the first
   completed step at world size 4 (tidal's job has max 4 nodes, torchrun's 3).

The systems, on the same script, machine and etcd, in the same run:

* ``tidal``: three ``tidal agent`` processes, the assignments written straight
  into etcd (the coordinator's part is left out, to isolate the agent path);
* ``torchrun etcd-v3``: plain torchrun on tidal's rendezvous backend and its
  defaults;
* ``torchrun c10d default``: torch's own backend, its defaults;
* ``torchrun c10d tuned``: keep-alive 1 s x 3, last call 1 s, close 1 s,
  heartbeat (the keep-alive write's own timeout) 1 s, and TCP-store sharing off
  (without which a joining node never gets a master address).

Node ``c`` is killed, not ``a``: with c10d, ``a`` hosts the rendezvous store
(``is_host`` is set as torch would infer it on separate machines) and is rank 0,
and killing it ends the job. Every torchrun gets ``--max-restarts=100``
(torch's default, 0, ends the job at the first membership change) and
``--monitor-interval=0.1`` (torch's default; tidal's runner uses the same).

A run that does not recover (or scale up) within its deadline, or whose
nodes all exit, is reported as such. It prints the machine's load, the table
(median and worst over the repetitions, ratios tidal / torchrun) and where
the time went: every process gets ``LOGLEVEL=INFO``, so torch's elastic agent
(inside tidal's runner, or torchrun) logs each round's result, and the
survivors' logs give *notice* (until an agent acts on the change), *rendezvous*
(until the last one has the new round) and *start-up* (until the first step).
No assertion is made on time.

A second benchmark, ``test_bench_planned_resizes_live_and_restart`` (select it
alone with ``-k planned``; ``BENCH_RECOVERY_SYSTEMS=live`` or ``plain`` runs
one script only), runs the planned changes of
tests/e2e/test_live_resize.py on a real coordinator and agents: a join onto a
node already up (PATCH max_nodes 2 -> 3), a drain, a cold join (an agent
starts) and a PATCH scale-down (3 -> 2), each with examples/mlp.py
``--live-resize`` (the live path: the workers re-form their process group and
train on) and without it (the restart path: stop, save, restart from the
checkpoint), interleaved in the same run. Its figure is the **training
pause**, the longest gap between consecutive steps around the change, beside
the time from the change to the first step at the new size, the steps taken
again and the path the runners of the nodes that stayed say they took.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from examples.torchrun_scenario import descendants
from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment
from tests.e2e.test_live_resize import (
    CHANGE_DEADLINE_S,
    Change,
    Step,
    mlp_spec,
    path_taken,
    planned_changes,
    start_job,
    steps,
)
from tests.support.agents import ELASTIC_DDP, AgentCluster, assign, unassign, warm_runner_ready
from tests.support.coordinator import coordinator_and_agents
from tests.support.processes import ProcessGroupRegistry

REPEATS = int(os.environ.get("BENCH_RECOVERY_REPEATS", "3"))
STEP_SECONDS = 0.1
START_DEADLINE_S = 120.0
RECOVERY_DEADLINE_S = 90.0  # c10d's defaults need about 45 s
SCALE_UP_DEADLINE_S = 75.0  # c10d waits 60 s for a master address that never comes
STEADY_S = 1.0  # steps taken at a size before the next event
VICTIM, JOINER, WARM_JOINER = "c", "d", "e"
MARKER = "BENCH_RECOVERY_RUN"  # in every process this benchmark starts, for the sweep

C10D_TUNED = (
    "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,"
    "close_timeout=1,heartbeat_timeout=1"
)


# Nodes of one job: the contract each system implements ------------------------


class Nodes(ABC):
    """The nodes of one elastic job on loopback, all logging steps to ``events``.

    ``kill`` must take every process of the node with it, as a dying machine
    would; ``close`` kills whatever is left and is called in a ``finally``.
    """

    def __init__(self, workdir: Path, procs: ProcessGroupRegistry) -> None:
        self.workdir = workdir
        self.procs = procs
        self.events = workdir / "events.jsonl"
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        workdir.mkdir(parents=True, exist_ok=True)

    def worker_args(self) -> list[str]:
        return [
            "--checkpoint", str(self.workdir / "ckpt-{node}.pt"),
            "--events", str(self.events),
            "--step-seconds", str(STEP_SECONDS),
        ]

    def running(self, node: str) -> bool:
        """Whether the node's top process (agent, or torchrun) still runs."""
        return self.started[node].poll() is None

    #: Whether a node can be started before it is given the job (tidal's agents).
    starts_idle = False

    def start_idle(self, node: str) -> None:
        raise NotImplementedError

    def give_job(self, node: str) -> None:
        raise NotImplementedError

    def ready_for_job(self, node: str) -> bool:
        raise NotImplementedError

    @abstractmethod
    def start(self, node: str) -> None: ...

    @abstractmethod
    def kill(self, node: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def elastic_log(self, node: str) -> Path:
        """Where torch's elastic agent of ``node`` logs (LOGLEVEL=INFO)."""


class TidalNodes(Nodes):
    """``tidal agent`` processes; the job's assignments are written straight into etcd."""

    def __init__(
        self, workdir: Path, procs: ProcessGroupRegistry, *, endpoint: str, root: str
    ) -> None:
        super().__init__(workdir, procs)
        self.cluster = AgentCluster(
            etcd_endpoint=endpoint, etcd_root=root, workdir=workdir, procs=procs
        )
        self.client = create_client(EtcdConfig(endpoints=[endpoint], root=root, timeout_s=10))
        self.job = Assignment(
            job_id="recovery",
            command=[sys.executable, str(ELASTIC_DDP), *self.worker_args()],
            cwd=str(workdir),
            min_nodes=1,
            max_nodes=4,  # e, warm, joins last
            max_restarts=3,
            grace_period_s=10,
        )

    starts_idle = True

    def start(self, node: str) -> None:
        self.start_idle(node)
        self.give_job(node)

    def start_idle(self, node: str) -> None:
        self.started[node] = self.cluster.start_agent(node)

    def give_job(self, node: str) -> None:
        assign(self.client, node, self.job)

    def ready_for_job(self, node: str) -> bool:
        return warm_runner_ready(self.workdir / node)

    def kill(self, node: str) -> None:
        self.cluster.kill_agent(node)  # runner and workers die with it (parent-death signal)
        unassign(self.client, node, self.job.job_id)  # what the coordinator does on node loss

    def close(self) -> None:
        for node in self.cluster.agents:
            self.cluster.kill_agent(node)
        self.client.close()

    def elastic_log(self, node: str) -> Path:
        return self.workdir / node / "jobs" / self.job.job_id / "gen-1" / "runner.log"


class TorchrunNodes(Nodes):
    """Plain ``torchrun`` processes, one per node, each in its own process group."""

    def __init__(
        self,
        workdir: Path,
        procs: ProcessGroupRegistry,
        *,
        backend: str,
        endpoint: str,
        rdzv_conf: str = "",
        env: dict[str, str] | None = None,
        host_node: str | None = None,
    ) -> None:
        super().__init__(workdir, procs)
        self.backend = backend
        self.endpoint = endpoint
        self.rdzv_conf = rdzv_conf
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        self.host_node = host_node

    def command(self, node: str) -> list[str]:
        conf = [self.rdzv_conf] if self.rdzv_conf else []
        if self.host_node is not None:  # c10d: who hosts the store, as on separate machines
            conf.append(f"is_host={int(node == self.host_node)}")
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}",
            "--rdzv-id=recovery",
            "--nnodes=1:3",
            "--nproc-per-node=1",
            "--max-restarts=100",
            "--monitor-interval=0.1",
            *([f"--rdzv-conf={','.join(conf)}"] if conf else []),
            str(ELASTIC_DDP), *self.worker_args(), "--node-name", node,
        ]

    def start(self, node: str) -> None:
        self.started[node] = self.procs.spawn(
            self.command(node), log_path=self.elastic_log(node), env=self.env
        )

    def kill(self, node: str) -> None:
        """torchrun's process group and every worker below it (workers have sessions
        of their own, so the group alone would leave them training)."""
        proc = self.started[node]
        tree = descendants(proc.pid)
        self.procs.signal_group(proc, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def close(self) -> None:
        for node in self.started:
            self.kill(node)

    def elastic_log(self, node: str) -> Path:
        return self.workdir / f"{node}.log"


# Reading what happened ---------------------------------------------------------


# torch's Python loggers (glog style); a worker's C++ lines ("[E1123 ...") are left out.
_GLOG = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d{6})")


def _stamp(line: str) -> float | None:
    """When a log line was written: logging's asctime, or torch's glog-style prefix."""
    with contextlib.suppress(ValueError):
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    match = _GLOG.match(line)
    if match is None:
        return None  # a worker's output, or a continuation line
    year = datetime.now().year  # glog leaves the year out
    return datetime.strptime(f"{year}{match[1]} {match[2]}", "%Y%m%d %H:%M:%S.%f").timestamp()


def first_line(path: Path, *, after: float, containing: str = "") -> float | None:
    """When ``path`` first logged a time-stamped line containing ``containing`` after ``after``."""
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        stamp = _stamp(line)
        if stamp is not None and stamp > after and containing in line:
            return stamp
    return None


def breakdown(
    nodes: Nodes, *, since: float, first_step: float, noticing: list[str], joining: list[str],
    size: int,
) -> dict[str, float]:
    """Where the time from ``since`` to ``first_step`` went, from the elastic agents' logs.

    notice: until the first of ``noticing`` logs anything (a worker failed, a
    node waits to join); rendezvous: until the last of ``joining`` logs the
    new round's result (``group_world_size=size``); start-up: until the first
    step (workers start, import torch, form the gloo group, agree on the
    checkpoint, take a step). Empty if a log lacks a line.
    """
    noticed = [first_line(nodes.elastic_log(n), after=since) for n in noticing]
    joined = [
        first_line(nodes.elastic_log(n), after=since, containing=f"group_world_size={size}")
        for n in joining
    ]
    if None in noticed or None in joined:
        return {}
    notice, rendezvous = min(t for t in noticed if t), max(t for t in joined if t)
    return {
        "notice": notice - since,
        "rendezvous": rendezvous - notice,
        "start-up": first_step - rendezvous,
    }


class Events:
    """The job's step records, read incrementally (the file grows by ~30 lines a second)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # a line being written waits for the next read
            self._offset += end
            for line in chunk[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.records.append(json.loads(line))
        return self.records

    def first(
        self,
        size: int,
        *,
        after: float,
        deadline_s: float,
        alive: Callable[[], bool],
        everyone: set[str] | None = None,
    ) -> dict[str, Any] | str:
        """The first record at world size ``size`` after ``after``, or why there is none.

        With ``everyone``, wait until each of those nodes logged a step at that
        size. Gives up at the deadline, or once ``alive()`` is false.
        """
        give_up = time.monotonic() + deadline_s
        while True:
            recent = [r for r in self.read() if r["time"] > after and r["world_size"] == size]
            if recent and (everyone is None or {r["node"] for r in recent} >= everyone):
                return min(recent, key=lambda r: r["time"])
            if time.monotonic() > give_up:
                return f"no step at world size {size} within {deadline_s:g} s"
            if not alive():
                waited = time.time() - after
                return f"no step at world size {size}: every node had exited after {waited:.0f} s"
            time.sleep(0.1)


@dataclass
class Outcome:
    """One repetition's figures; None where the deadline passed first."""

    recovery_s: float | None = None
    scale_up_tried: bool = False  # only after a recovery
    scale_up_s: float | None = None
    steps_lost: int | None = None
    recovery_parts: dict[str, float] = field(default_factory=dict)
    scale_up_parts: dict[str, float] = field(default_factory=dict)
    warm_scale_up_s: float | None = None
    warm_scale_up_parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def measure(nodes: Nodes) -> Outcome:
    """Start a, b, c; kill c; start d. The caller closes ``nodes``."""
    out = Outcome()
    events = Events(nodes.events)

    def alive() -> bool:
        return any(nodes.running(n) for n in nodes.started if n != VICTIM)

    started = time.time()
    for node in ("a", "b", "c"):
        nodes.start(node)
    if nodes.starts_idle:
        nodes.start_idle(WARM_JOINER)
    first = events.first(3, after=started, deadline_s=START_DEADLINE_S, alive=alive,
                         everyone={"a", "b", "c"})
    if isinstance(first, str):
        out.notes.append(f"start: {first}")
        return out
    time.sleep(STEADY_S)
    t_kill = time.time()
    nodes.kill(VICTIM)
    first = events.first(2, after=t_kill, deadline_s=RECOVERY_DEADLINE_S, alive=alive)
    if isinstance(first, str):
        out.notes.append(f"after the kill: {first}")
        return out
    out.recovery_s = first["time"] - t_kill
    # The survivors can finish the step in flight after the kill (the dead node
    # had done its part of the all-reduce): that step counts as completed.
    before = [r for r in events.records if r["time"] < first["time"]]
    last_done = max(r["step"] for r in before if r["world_size"] == 3)
    out.steps_lost = last_done - (first["step"] - 1)
    out.recovery_parts = breakdown(nodes, since=t_kill, first_step=first["time"],
                                   noticing=["a", "b"], joining=["a", "b"], size=2)
    detour = sorted({r["world_size"] for r in before if r["time"] > t_kill} - {3})
    if detour:
        out.notes.append(f"trained at world size {detour} before 2")
    time.sleep(STEADY_S)
    t_join = time.time()
    out.scale_up_tried = True
    nodes.start(JOINER)
    grown = events.first(3, after=t_join, deadline_s=SCALE_UP_DEADLINE_S, alive=alive)
    if isinstance(grown, str):
        out.notes.append(f"after d started: {grown}")
        return out
    out.scale_up_s = grown["time"] - t_join
    out.scale_up_parts = breakdown(nodes, since=t_join, first_step=grown["time"],
                                   noticing=["a", "b"], joining=["a", "b", "d"], size=3)
    if nodes.starts_idle:
        measure_warm_scale_up(nodes, events, out, alive)
    return out


def measure_warm_scale_up(nodes: Nodes, events: Events, out: Outcome,
                          alive: Callable[[], bool]) -> None:
    """Give the job to ``e``, whose agent has been up since the start."""
    give_up = time.monotonic() + SCALE_UP_DEADLINE_S
    while not nodes.ready_for_job(WARM_JOINER):
        if time.monotonic() > give_up:
            out.notes.append("e's warm runner was never ready")
            return
        time.sleep(0.1)
    time.sleep(STEADY_S)
    t_assign = time.time()
    nodes.give_job(WARM_JOINER)
    grown = events.first(4, after=t_assign, deadline_s=SCALE_UP_DEADLINE_S, alive=alive)
    if isinstance(grown, str):
        out.notes.append(f"after e was given the job: {grown}")
        return
    out.warm_scale_up_s = grown["time"] - t_assign
    out.warm_scale_up_parts = breakdown(
        nodes, since=t_assign, first_step=grown["time"],
        noticing=["a", "b", "d"], joining=["a", "b", "d", "e"], size=4,
    )


# Systems, cleanup, the table ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


MakeNodes = Callable[[Path, ProcessGroupRegistry, int], Nodes]


def _systems(etcd: EtcdServer, root: str) -> dict[str, MakeNodes]:
    def tidal(workdir: Path, procs: ProcessGroupRegistry, rep: int) -> Nodes:
        return TidalNodes(workdir, procs, endpoint=etcd.endpoint, root=f"{root}-tidal-{rep}")

    def etcd_v3(workdir: Path, procs: ProcessGroupRegistry, rep: int) -> Nodes:
        return TorchrunNodes(workdir, procs, backend="etcd-v3", endpoint=etcd.endpoint,
                             env={"TIDAL_ETCD_ROOT": f"{root}-etcd-v3-{rep}"})

    def c10d_default(workdir: Path, procs: ProcessGroupRegistry, rep: int) -> Nodes:
        return TorchrunNodes(workdir, procs, backend="c10d", host_node="a",
                             endpoint=f"127.0.0.1:{_free_port()}")

    def c10d_tuned(workdir: Path, procs: ProcessGroupRegistry, rep: int) -> Nodes:
        return TorchrunNodes(workdir, procs, backend="c10d", host_node="a",
                             endpoint=f"127.0.0.1:{_free_port()}", rdzv_conf=C10D_TUNED,
                             env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})

    return {
        "tidal": tidal,
        "torchrun etcd-v3": etcd_v3,
        "torchrun c10d default": c10d_default,
        "torchrun c10d tuned": c10d_tuned,
    }


def _selected(names: list[str]) -> list[str]:
    wanted = os.environ.get("BENCH_RECOVERY_SYSTEMS", "")
    if not wanted:
        return names
    keys = [w.strip() for w in wanted.split(",") if w.strip()]
    return [n for n in names if any(k in n for k in keys)]


def _marked_pids(marker: str) -> list[int]:
    """Live processes (not this one) whose environment carries this run's marker."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


@contextlib.contextmanager
def _no_leftovers(procs: ProcessGroupRegistry, marker: str) -> Iterator[None]:
    """Kill every group started here, then anything else of this run that survived."""
    try:
        yield
    finally:
        procs.stop_all()
        for pid in _marked_pids(marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _fmt(value: float | None, deadline: float) -> str:
    if value is None or math.isinf(value):
        return f"> {deadline:g}"
    return f"{value:.1f}"


def _med_worst(values: list[float | None]) -> tuple[float, float]:
    """Median and worst, a missed deadline counting as infinitely long."""
    xs = [math.inf if v is None else v for v in values]
    return statistics.median(xs), max(xs)


def _load() -> tuple[float, float, float]:
    return os.getloadavg()


def _load_text(samples: list[tuple[float, float, float]]) -> str:
    ones = [s[0] for s in samples]
    first, last = samples[0], samples[-1]
    return (
        f"{os.cpu_count()} cores; load average (1, 5, 15 min) at the start "
        f"{first[0]:.2f}, {first[1]:.2f}, {first[2]:.2f}, at the end "
        f"{last[0]:.2f}, {last[1]:.2f}, {last[2]:.2f}; 1-min load after each run "
        f"{min(ones):.2f} to {max(ones):.2f}"
    )


def report(results: dict[str, list[Outcome]], loads: list[tuple[float, float, float]]) -> str:
    """The table printed at the end (markdown, as it goes into docs/benchmarks.md)."""
    lines = [
        f"{REPEATS} repetition(s); {_load_text(loads)}",
        "",
        "| system | recovery median (s) | recovery worst (s) | scale-up median (s) "
        "| scale-up worst (s) | steps lost (median / worst) | recovered | scaled up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, outs in results.items():
        rec = _med_worst([o.recovery_s for o in outs])
        tried = [o for o in outs if o.scale_up_tried]
        up = _med_worst([o.scale_up_s for o in tried]) if tried else None
        lost = [o.steps_lost for o in outs if o.steps_lost is not None]
        cells = [
            _fmt(rec[0], RECOVERY_DEADLINE_S),
            _fmt(rec[1], RECOVERY_DEADLINE_S),
            _fmt(up[0], SCALE_UP_DEADLINE_S) if up else "not tried",
            _fmt(up[1], SCALE_UP_DEADLINE_S) if up else "not tried",
            f"{statistics.median(lost):g} / {max(lost)}" if lost else "-",
            f"{sum(o.recovery_s is not None for o in outs)}/{len(outs)}",
            f"{sum(o.scale_up_s is not None for o in tried)}/{len(tried)}",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "tidal" in results:
        lines += _ratios(results)
    lines += [*_breakdowns(results), *_warm(results), ""]
    for name, outs in results.items():
        for i, o in enumerate(outs):
            if o.notes:
                lines.append(f"{name}, repetition {i + 1}: {'; '.join(o.notes)}")
    return "\n".join(lines)


def _ratio(tidal: float, other: float, other_deadline: float) -> str:
    """tidal / other; where ``other`` missed its deadline, an upper bound."""
    if math.isinf(tidal):
        return "-"
    if math.isinf(other):
        return f"< {tidal / other_deadline:.2f}"
    return f"{tidal / other:.2f}"


def _ratios(results: dict[str, list[Outcome]]) -> list[str]:
    tidal_rec = _med_worst([o.recovery_s for o in results["tidal"]])
    tidal_up = _med_worst([o.scale_up_s for o in results["tidal"] if o.scale_up_tried] or [None])
    lines = [
        "",
        "| tidal / | recovery median | recovery worst | scale-up median | scale-up worst |",
        "|---|---|---|---|---|",
    ]
    for name, outs in results.items():
        if name == "tidal":
            continue
        rec = _med_worst([o.recovery_s for o in outs])
        tried = [o for o in outs if o.scale_up_tried]
        up = _med_worst([o.scale_up_s for o in tried]) if tried else None
        cells = [
            _ratio(tidal_rec[0], rec[0], RECOVERY_DEADLINE_S),
            _ratio(tidal_rec[1], rec[1], RECOVERY_DEADLINE_S),
            _ratio(tidal_up[0], up[0], SCALE_UP_DEADLINE_S) if up else "-",
            _ratio(tidal_up[1], up[1], SCALE_UP_DEADLINE_S) if up else "-",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _breakdowns(results: dict[str, list[Outcome]]) -> list[str]:
    """Medians of where the time went, per system, from the elastic agents' logs."""
    keys = ("notice", "rendezvous", "start-up")
    lines = [
        "",
        "| medians (s), from the logs | recovery: " + " | recovery: ".join(keys)
        + " | scale-up: " + " | scale-up: ".join(keys) + " |",
        "|---|" + "---|" * 2 * len(keys),
    ]
    for name, outs in results.items():
        cells = []
        for attr in ("recovery_parts", "scale_up_parts"):
            parts = [getattr(o, attr) for o in outs if getattr(o, attr)]
            cells += [f"{statistics.median(p[k] for p in parts):.1f}" if parts else "-"
                      for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _warm(results: dict[str, list[Outcome]]) -> list[str]:
    """tidal's scale-up onto a node that was up (warm runner ready) before its assignment."""
    outs = [o for o in results.get("tidal", []) if o.scale_up_s is not None]
    if not outs:
        return []
    med, worst = _med_worst([o.warm_scale_up_s for o in outs])
    parts = [o.warm_scale_up_parts for o in outs if o.warm_scale_up_parts]
    keys = ("notice", "rendezvous", "start-up")
    split = " / ".join(f"{statistics.median(p[k] for p in parts):.1f}" for k in keys) if parts \
        else "-"
    return [
        "",
        "| tidal, node up before its assignment | scale-up median (s) | scale-up worst (s) "
        "| notice / rendezvous / start-up, medians (s) | scaled up |",
        "|---|---|---|---|---|",
        f"| from the assignment to the first step at world size 4 | "
        f"{_fmt(med, SCALE_UP_DEADLINE_S)} | {_fmt(worst, SCALE_UP_DEADLINE_S)} | {split} | "
        f"{sum(o.warm_scale_up_s is not None for o in outs)}/{len(outs)} |",
    ]


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    """This run's marker, inherited by everything started below (see _no_leftovers)."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, value)
    return value


R = TypeVar("R")


def interleaved(
    names: list[str], run: Callable[[str, int, Path, ProcessGroupRegistry], R], *,
    tmp_path: Path, marker: str, label: str = "",
) -> tuple[dict[str, list[R]], list[tuple[float, float, float]]]:
    """``run(name, repetition, workdir, procs)`` REPEATS times for each name, the
    names interleaved so that a load burst does not hit one only; every process
    a run started is gone before the next. Returns the results and the loads."""
    results: dict[str, list[R]] = {name: [] for name in names}
    loads = [_load()]
    for rep in range(REPEATS):
        for name in names:
            workdir = tmp_path / f"{label}{name.replace(' ', '-')}-{rep}"
            procs = ProcessGroupRegistry()
            with _no_leftovers(procs, marker):
                outcome = run(name, rep, workdir, procs)
            results[name].append(outcome)
            loads.append(_load())
            print(f"\n{label}{name}, repetition {rep + 1}: {outcome} "
                  f"(1-min load {loads[-1][0]:.2f}; logs in {workdir})")
    return results, loads


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_bench_recovery_and_scale_up(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, marker: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOGLEVEL", "INFO")  # torch elastic logs its rounds: the breakdown
    systems = _systems(etcd_server, etcd_root)

    def run(name: str, rep: int, workdir: Path, procs: ProcessGroupRegistry) -> Outcome:
        nodes = systems[name](workdir, procs, rep)
        try:
            return measure(nodes)
        finally:
            nodes.close()

    results, loads = interleaved(_selected(list(systems)), run, tmp_path=tmp_path, marker=marker)
    print("\n" + report(results, loads))
    assert all(results.values())


# Planned resizes: the live path against the restart path -----------------------
#
# examples/mlp.py on a real coordinator and real agents, through the changes of
# tests/e2e/test_live_resize.py (a join onto a node already up, a drain, a cold
# join, a PATCH scale-down), once with --live-resize and once without (today's
# restart from the checkpoint the workers save at their stop), interleaved in
# the same run. The figure is the training pause: the longest gap between two
# consecutive steps (rank 0's log lines) from the last step before the change
# to the PAUSE_STEPS-th step at its new size; a cold join's pause is not
# counted from the agent's start, whose seconds the others spend training.

#: script -> whether it uses live resize (examples/mlp.py --live-resize)
PLANNED_MODES = {"live-resize": True, "plain": False}
PAUSE_STEPS = 3


@dataclass
class Resized:
    """One planned change in one run."""

    change: str
    pause_s: float
    to_size_s: float  # from the change to the first step at its size
    redone: int  # steps taken again (their first run was lost)
    path: str  # what the status records of the nodes that stayed say


@dataclass
class PlannedRun:
    resized: list[Resized] = field(default_factory=list)
    steady_s: float | None = None  # median gap between steps before the first change
    notes: list[str] = field(default_factory=list)


def pause_around(taken: list[Step], change: Change) -> tuple[float, int]:
    """The longest gap between rank 0's consecutive steps around ``change``, and how
    many steps in that window had been taken before."""
    zero = [s for s in taken if s.rank == 0]
    before = [s for s in zero if s.time <= change.at]
    after = [s for s in zero if s.time >= change.reached][:PAUSE_STEPS]
    if not before or not after:
        return math.inf, 0
    window = [s for s in zero if before[-1].time <= s.time <= after[-1].time]
    gaps = [b.time - a.time for a, b in itertools.pairwise(window)]
    seen = {s.step for s in zero if s.time <= before[-1].time}
    return max(gaps, default=math.inf), sum(s.step in seen for s in window[1:])


def measure_planned(workdir: Path, procs: ProcessGroupRegistry, etcd: EtcdServer, root: str,
                    *, live: bool) -> PlannedRun:
    """A coordinator, agents a, b, c (d later) and one job through the planned changes."""
    out = PlannedRun()
    workdir.mkdir(parents=True)
    with coordinator_and_agents(
        tmp_path=workdir, etcd_server=etcd, etcd_root=root, procs=procs
    ) as (coordinator, agents):
        api = coordinator.client()
        client = create_client(EtcdConfig(endpoints=[etcd.endpoint], root=root, timeout_s=10))
        done: list[Change] = []
        try:
            job_id = start_job(api, agents, workdir,
                               mlp_spec(workdir, live=live, total_steps=1_000_000), spares=("c",))
            planned_changes(api, agents, client, workdir, job_id, done, cold=True)
        except TimeoutError as exc:
            out.notes.append(str(exc))
        finally:
            client.close()
    taken = steps(workdir)
    first = done[0].at if done else math.inf
    warm = [s.time for s in taken if s.rank == 0 and s.time < first]
    gaps = [b - a for a, b in itertools.pairwise(warm)]
    out.steady_s = statistics.median(gaps) if gaps else None
    for change in done:
        pause, redone = pause_around(taken, change)
        out.resized.append(Resized(change.name, pause, change.reached - change.at, redone,
                                   path_taken(change)))
    return out


def planned_report(results: dict[str, list[PlannedRun]],
                   loads: list[tuple[float, float, float]]) -> str:
    """The planned-resize table (markdown): per change, the live path beside the restart."""
    repeats = max((len(r) for r in results.values()), default=0)
    steady = [r.steady_s for runs in results.values() for r in runs if r.steady_s is not None]
    lines = [
        f"{repeats} repetition(s); {_load_text(loads)}; a step every "
        f"{statistics.median(steady) if steady else math.nan:.2f} s (median) before the changes",
        "",
        "| change | script | pause median (s) | pause worst (s) | change to first step "
        "at the new size, median (s) | steps redone (worst) | path taken (staying nodes) | done |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = list(dict.fromkeys(c.change for runs in results.values() for r in runs
                               for c in r.resized))
    for name in names:
        for mode, runs in results.items():
            rows = [c for r in runs for c in r.resized if c.change == name]
            pause = _med_worst([c.pause_s for c in rows] + [None] * (len(runs) - len(rows)))
            to_size = _med_worst([c.to_size_s for c in rows] or [None])
            taken = sorted({c.path for c in rows})
            cells = [
                name, mode, _fmt(pause[0], CHANGE_DEADLINE_S), _fmt(pause[1], CHANGE_DEADLINE_S),
                _fmt(to_size[0], CHANGE_DEADLINE_S), str(max((c.redone for c in rows), default=0)),
                ", ".join(taken) or "-", f"{len(rows)}/{len(runs)}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    for mode, runs in results.items():
        for i, r in enumerate(runs):
            if r.notes:
                lines.append(f"{mode}, repetition {i + 1}: {'; '.join(r.notes)}")
    return "\n".join(lines)


@pytest.mark.bench
@pytest.mark.timeout(3600)
def test_bench_planned_resizes_live_and_restart(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, marker: str
) -> None:
    def run(mode: str, rep: int, workdir: Path, procs: ProcessGroupRegistry) -> PlannedRun:
        return measure_planned(workdir, procs, etcd_server, f"{etcd_root}-{mode}-{rep}",
                               live=PLANNED_MODES[mode])

    results, loads = interleaved(_selected(list(PLANNED_MODES)), run, tmp_path=tmp_path,
                                 marker=marker, label="planned-")
    print("\n" + planned_report(results, loads))
    assert all(results.values())
