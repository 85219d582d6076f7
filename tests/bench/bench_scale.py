"""Benchmark: recovery and resize at scale, which part of the pause grows with the node count.

Run with
``flock /tmp/tidal-quiet.lock .venv/bin/python -m pytest tests/bench/bench_scale.py -m bench -s``
(a few minutes; ``BENCH_SCALE_NODES``, 8,32 by default, e.g. ``8,32,128``;
``BENCH_SCALE_REPEATS``, 2 of each change; ``BENCH_SCALE_BUSY_AT``, the node
count also run beside one busy-loop process per core, 8; ``BENCH_SCALE_WORKERS``,
the world sizes of the workers' part, 8,32).

128 real agents, each with a warm runner, a zygote and a torch worker, do not
fit on a 2-core machine: their start-up alone is minutes of CPU, and what
they measured would be the queue for the CPU. So the pause is taken apart:

* **the rendezvous** (tests/support/rdzv_swarm.py): N members against the
  real etcd, each a process of its own with its own etcd client and real
  :class:`~rendezvous.elastic.assigned.AssignedRendezvousHandler`, doing what the
  runner does with it (ask ``pending_change`` every 0.1 s, join the next
  round). Per change, timed from the bench's act: *a kill* (SIGKILL of a
  member: the restart path's detection through the liveness port), *a join*
  (a new member: the live path's join; its own start-up is reported apart)
  and *a planned leave* (SIGTERM: ``announce_leaving``, then leave once the
  others' round formed). Phases: *first / last notice* (the first and the
  last survivor whose ``pending_change`` says so), *all in the new round*
  (the last member back from ``next_rendezvous``), *formation* (all in minus
  last notice).
* **the workers' re-init** (the live path's, and the restart path's once the
  processes are up): N torch processes form a gloo group of world size N,
  wrap a tiny model in DDP after receiving rank 0's state, step once; then
  destroy the group and form it again (the live path's re-init at the new
  round). Process start-up and torch's import are left out (a zygote's
  fork); bench_recovery and bench_churn measure them on real agents.

CPU contention apart from the protocol's cost, per change: the CPU seconds
the members and etcd used (``/proc/PID/stat``, every thread) and that sum
over the cores (the least wall time this machine needs for the work alone:
where the formation is about that, it is CPU-bound here, and on N machines
each member's share, members' CPU / N, runs in parallel), the members'
run-queue wait (``/proc/PID/task/*/schedstat``: runnable but no CPU free,
summed over each member's threads) and the machine's busy share over the
change (``/proc/stat``); and the same changes at ``BENCH_SCALE_BUSY_AT`` nodes
beside one busy-loop process per core. No assertion is made on time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rendezvous.etcd.server import EtcdServer
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

NODES = [int(n) for n in os.environ.get("BENCH_SCALE_NODES", "8,32").split(",") if n]
REPEATS = int(os.environ.get("BENCH_SCALE_REPEATS", "2"))
BUSY_AT = int(os.environ.get("BENCH_SCALE_BUSY_AT", "8") or 0)
WORKERS = [int(n) for n in os.environ.get("BENCH_SCALE_WORKERS", "8,32").split(",") if n]
FORM_DEADLINE_S = 600.0
CHANGE_DEADLINE_S = 180.0
SETTLE_S = 1.0  # quiet between changes
SPAWN_BATCH = 16
TICK = os.sysconf("SC_CLK_TCK")


# /proc readings ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def runqueue_wait(pid: int) -> float:
    """Seconds ``pid``'s threads spent runnable but waiting for a CPU (schedstat)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


@dataclasses.dataclass
class Usage:
    members_cpu: float
    etcd_cpu: float
    runqueue: float
    busy: tuple[int, int]


def usage(pids: list[int], etcd_pid: int | None) -> Usage:
    return Usage(
        sum(cpu_seconds(p) for p in pids),
        cpu_seconds(etcd_pid) if etcd_pid else 0.0,
        sum(runqueue_wait(p) for p in pids),
        machine_busy(),
    )


# the swarm --------------------------------------------------------------------------------


class Swarm:
    """tests/support/rdzv_swarm.py's members: spawn, kill, ask to leave, read their events."""

    def __init__(self, etcd: EtcdServer, root: str, outdir: Path) -> None:
        outdir.mkdir(parents=True)
        self.outdir = outdir
        # Its own process group, the members' too (forked): stop() ends them all.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.rdzv_swarm", "members", etcd.endpoint, root,
             "scale", str(outdir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )
        self.pids: dict[str, int] = {}  # alive members, oldest first
        self.count = 0

    def spawn(self, n: int, first_min: int) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        nodes = [f"m{self.count + i}" for i in range(n)]
        self.count += n
        self.proc.stdin.write(f"spawn {first_min} {' '.join(nodes)}\n".encode())
        self.proc.stdin.flush()
        for _ in nodes:
            _, node, pid = self.proc.stdout.readline().decode().split()
            self.pids[node] = int(pid)
        return nodes

    def stop(self) -> None:
        ProcessGroupRegistry.signal_group(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def connected(self, nodes: list[str]) -> bool:
        """Whether each of ``nodes`` connected to etcd (or failed)."""
        return all(any(e["ev"] in ("joining", "failed") for e in self.events(n)) for n in nodes)

    def events(self, node: str) -> list[dict[str, Any]]:
        path = self.outdir / f"{node}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def failed(self) -> list[str]:
        """The tracebacks of the members that died of an exception."""
        return [e["error"] for n in self.pids for e in self.events(n) if e["ev"] == "failed"]

    def await_round(self, nodes: list[str], world: int, after: float, *, timeout: float,
                    what: str) -> None:
        """Wait until :meth:`in_round`; fail at once when a member failed."""
        wait_for(lambda: self.in_round(nodes, world, after) or self.failed(), timeout=timeout,
                 what=what, interval=0.1)
        failed = self.failed()
        assert not failed, f"{len(failed)} member(s) failed, the first:\n{failed[0]}"

    def in_round(self, nodes: list[str], world: int, after: float) -> bool:
        """Whether each of ``nodes`` is back from a round of ``world`` members since ``after``."""
        for node in nodes:
            rounds = [e for e in self.events(node) if e["ev"] == "round" and e["t"] > after]
            if not rounds or rounds[-1]["world"] != world:
                return False
        return True


@dataclasses.dataclass
class Change:
    size: int  # the swarm's size at its start
    nodes: int  # members before the change
    busy: bool
    kind: str  # kill, join, leave
    wall: float = 0.0  # the act to the last member in the new round
    first_notice: float | None = None
    last_notice: float | None = None
    formation: float | None = None
    joiner_up: float | None = None  # a join: the act to the new member's handler joining
    members_cpu: float = 0.0
    etcd_cpu: float = 0.0
    runqueue: float = 0.0  # summed over the members
    busy_share: float = 0.0  # of the machine's CPUs over the change


def one_change(swarm: Swarm, size: int, kind: str, busy: bool, etcd_pid: int | None) -> Change:
    alive = list(swarm.pids)
    out = Change(size, len(alive), busy, kind)
    gone = alive.pop(0) if kind != "join" else ""
    # The CPU of the members that stay (a leaver's ends with it, unread).
    counted = [p for n, p in swarm.pids.items() if n != gone]
    before = usage(counted, etcd_pid)
    act = time.time()
    if kind == "kill":
        os.kill(swarm.pids.pop(gone), signal.SIGKILL)
        stay, world = alive, len(alive)
    elif kind == "leave":
        leaver = gone
        os.kill(swarm.pids[leaver], signal.SIGTERM)
        stay, world = alive, len(alive)
    else:
        joiner = swarm.spawn(1, 1)[0]
        counted.append(swarm.pids[joiner])
        stay, world = [*alive, joiner], len(alive) + 1
    swarm.await_round(stay, world, act, timeout=CHANGE_DEADLINE_S,
                      what=f"{len(stay)} members in a round of {world} after a {kind}")
    if kind == "leave":
        wait_for(lambda: any(e["ev"] == "left" for e in swarm.events(leaver)), timeout=30,
                 what=f"{leaver} to leave", interval=0.1)
        swarm.pids.pop(leaver)
    after = usage(counted, etcd_pid)
    notices = [next((e["t"] for e in swarm.events(n) if e["ev"] == "noticed" and e["t"] > act),
                    None) for n in stay]
    seen = [t - act for t in notices if t is not None]
    # Each member's last round since the act: the one of ``world`` members (in_round).
    back = max(max(e["t"] for e in swarm.events(n) if e["ev"] == "round" and e["t"] > act)
               for n in stay)
    out.wall = back - act
    if seen:
        out.first_notice, out.last_notice = min(seen), max(seen)
        out.formation = out.wall - max(seen)
    if kind == "join":
        out.joiner_up = next(e["t"] for e in swarm.events(stay[-1]) if e["ev"] == "joining") - act
    out.members_cpu = after.members_cpu - before.members_cpu
    out.etcd_cpu = after.etcd_cpu - before.etcd_cpu
    out.runqueue = after.runqueue - before.runqueue
    jiffies = after.busy[1] - before.busy[1]
    out.busy_share = (after.busy[0] - before.busy[0]) / jiffies if jiffies else 0.0
    return out


def run_size(n: int, busy: bool, etcd: EtcdServer, root: str, workdir: Path) -> list[Change]:
    procs = ProcessGroupRegistry()
    changes: list[Change] = []
    swarm = Swarm(etcd, root, workdir / f"swarm-{n}{'-busy' if busy else ''}")
    try:
        if busy:
            for _ in range(os.cpu_count() or 1):
                procs.spawn([sys.executable, "-c", "while True: pass"],
                            log_path=workdir / "busy.log")
        start = time.time()
        nodes: list[str] = []
        # In batches: 128 etcd clients connecting in the same instant on a
        # loaded 2-core machine time out before etcd's first answer.
        while len(nodes) < n:
            nodes += swarm.spawn(min(SPAWN_BATCH, n - len(nodes)), n)
            wait_for(functools.partial(swarm.connected, list(nodes)), timeout=FORM_DEADLINE_S,
                     what="a batch of members to connect", interval=0.1)
        swarm.await_round(nodes, n, start, timeout=FORM_DEADLINE_S,
                          what=f"{n} members in one round")
        print(f"\n{n} members formed their first round in {time.time() - start:.1f} s")
        for _ in range(REPEATS):
            for kind in ("kill", "join", "leave"):
                time.sleep(SETTLE_S)
                changes.append(one_change(swarm, n, kind, busy, etcd.pid))
                print(changes[-1])
    finally:
        swarm.stop()
        procs.stop_all()
    return changes


# the workers' re-init ---------------------------------------------------------------------


def _free_ports() -> int:
    """A port whose successor looks free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


@dataclasses.dataclass
class Reinit:
    world: int
    parts: dict[str, dict[str, float]]  # first / reform -> part -> max over ranks
    cpu: float  # every worker's CPU seconds, both formations (the parent's imports left out)


def run_workers(world: int, workdir: Path) -> Reinit:
    outdir = workdir / f"workers-{world}"
    outdir.mkdir(parents=True)
    procs = ProcessGroupRegistry()
    try:
        proc = procs.spawn(
            [sys.executable, "-m", "tests.support.rdzv_swarm", "workers", str(world),
             str(_free_ports()), str(outdir)],
            log_path=workdir / f"workers-{world}.log",
        )
        _, _, rusage = os.wait4(proc.pid, 0)
        proc.returncode = 0
    finally:
        procs.stop_all()
    preload = json.loads((outdir / "parent.json").read_text())["cpu"]
    ranks = [json.loads(p.read_text()) for p in outdir.glob("*.json") if p.stem.isdigit()]
    assert len(ranks) == world, (workdir / f"workers-{world}.log").read_text()[-3000:]
    parts = {which: {k: max(r[which][k] for r in ranks) for k in ranks[0][which]}
             for which in ("first", "reform")}
    return Reinit(world, parts, rusage.ru_utime + rusage.ru_stime - preload)


# the report -------------------------------------------------------------------------------


def _med(values: list[float | None]) -> str:
    xs = [v for v in values if v is not None]
    return f"{statistics.median(xs):.2f}" if xs else "-"


def report(changes: list[Change], reinits: list[Reinit],
           loads: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    lines = [
        f"{os.cpu_count()} cores; load average (1, 5, 15 min) at the start "
        + ", ".join(f"{x:.2f}" for x in loads[0]) + ", at the end "
        + ", ".join(f"{x:.2f}" for x in loads[1]) + f"; {REPEATS} of each change, medians",
        "",
        "Rendezvous (real etcd, one process per member):",
        "",
        "| members (at the start) | competitors | change | first notice (s) | last notice (s) "
        "| formation (s) | all in new round (s) | joiner's start-up (s) | members' CPU (s) "
        "| etcd CPU (s) | CPU / cores (s) | run-queue wait per member, all threads (s) "
        "| machine busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = ("kill", "join", "leave")
    keys = sorted({(c.busy, c.size, order.index(c.kind)) for c in changes})
    for busy, size, index in keys:
        kind = order[index]
        group = [c for c in changes if (c.busy, c.size, c.kind) == (busy, size, kind)]
        lines.append("| " + " | ".join([
            str(size), f"{os.cpu_count()} busy loops" if busy else "none", kind,
            _med([c.first_notice for c in group]), _med([c.last_notice for c in group]),
            _med([c.formation for c in group]), _med([c.wall for c in group]),
            _med([c.joiner_up for c in group]), _med([c.members_cpu for c in group]),
            _med([c.etcd_cpu for c in group]),
            _med([(c.members_cpu + c.etcd_cpu) / (os.cpu_count() or 1) for c in group]),
            _med([c.runqueue / max(1, c.nodes) for c in group]),
            f"{100 * statistics.median(c.busy_share for c in group):.0f}%",
        ]) + " |")
    if reinits:
        lines += [
            "",
            "Workers' re-init (gloo, tiny model; slowest rank; first formation / re-formation):",
            "",
            "| world size | init_process_group (s) | state sync + DDP (s) | first step (s) "
            "| total (s) | CPU of all workers, both formations (s) |",
            "|---|---|---|---|---|---|",
        ]
        for r in reinits:
            f, g = r.parts["first"], r.parts["reform"]
            lines.append("| " + " | ".join([
                str(r.world),
                *[f"{f[k]:.2f} / {g[k]:.2f}"
                  for k in ("init_process_group", "state_sync+ddp", "first_step", "total")],
                f"{r.cpu:.1f}",
            ]) + " |")
    return "\n".join(lines)


@pytest.mark.bench
@pytest.mark.timeout(3 * 3600)
def test_bench_rendezvous_and_reinit_at_scale(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str
) -> None:
    load_start = os.getloadavg()
    changes: list[Change] = []
    sizes = [(n, False) for n in NODES] + ([(BUSY_AT, True)] if BUSY_AT else [])
    for n, busy in sizes:
        changes += run_size(n, busy, etcd_server, f"{etcd_root}-{n}{'-busy' if busy else ''}",
                            tmp_path)
    reinits = [run_workers(w, tmp_path) for w in WORKERS]
    for r in reinits:
        print(r)
    print("\n" + report(changes, reinits, (load_start, os.getloadavg())))
    assert changes
