"""The count benchmark: what one rendezvous round costs, counted exactly, against N (issue #24).

``python -m tests.bench.scale_counts --nodes 8,64,256,1024 --out build/bench-scale.json``
(``make bench-scale``) runs N members of the agents' rendezvous
(:class:`~rendezvous.elastic.assigned.AssignedRendezvousHandler`) as threads of this one
process, on a real etcd (its own, on a free loopback port) with real sockets: each
member has the handler's own watches, leases and liveness sockets; the members share
a few etcd clients (gRPC channels) so that 1,024 of them fit one process. Each member
does what a runner does with its handler (tests/support/rdzv_swarm.py): ask
``pending_change`` every 0.1 s (one ticker thread asks for every member and wakes the
member's thread when there is a change), join the next round when there is one.

For each change (``kill``: a member's sockets close and its keep-alives stop, as
when its process dies; ``kill-leader``: the same for the member that writes rounds,
rank 0 where no member does; ``join``: a new member; ``leave``: a planned leave,
``announce_leaving`` then ``leave``) one row, counted between the act and the moment
every survivor is back from ``next_rendezvous`` in a round of the right size and
etcd has gone quiet:

* ``etcd_write_txns``: raft proposals etcd committed (every put, delete, transaction
  with a write, whether its compare held or not, lease grant and revoke;
  ``etcd_server_proposals_committed_total``); ``etcd_txns``: Txn calls handled;
* ``watch_events``: events etcd sent to watchers (``etcd_debugging_mvcc_events_total``);
* ``etcd_bytes_out``: bytes etcd sent to clients
  (``etcd_network_client_grpc_sent_bytes_total``; keep-alive answers included);
* ``liveness_connects``: TCP connections the members' liveness code opened
  (``socket.create_connection`` called from :mod:`rendezvous.elastic.liveness`);
* ``per_member_cpu_ms`` (mean over the survivors but the leader) and ``leader_cpu_ms``:
  CPU of each member's threads (their names end in the node id), from
  ``/proc/self/task``; ``process_cpu_ms``: the whole process (gRPC's own threads too);
* ``dropped``: survivors not back in the round of the right size by the deadline, or
  whose handler failed; ``formation_s``: the act to the last survivor back.

``--soak N`` runs instead ten
consecutive changes at N members beside ``--busy`` (2) Python processes that each spin a
CPU (started and stopped here, by process group), and checks each: ``leases_lost`` (keepers
that declared their lease lost, counted in this process), ``false_losses`` (``m/lost/``
marks of members neither killed nor gone by a leave), ``world_exact`` (every survivor's
every round since the act has the new size) and ``dropped``.

Wall times on a shared 2-core machine measure contention more than the protocol; the
counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc import _common as grpc_common

from rendezvous.elastic.assigned import AssignedRendezvousHandler
from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.keys import Keys
from rendezvous.lease import LeaseKeeper

POLL_S = 0.1  # agent/runner/elastic.py's monitor_interval
IDLE_WAKE_S = 5.0  # how often a thread blocked on gRPC wakes with nothing to do (below)
LEASE_TTL_S = 10
CLIENTS = 16  # gRPC channels the members share
CHANGE_DEADLINE_S = 300.0
QUIET_S = 0.5  # etcd's proposals and events unchanged this long: the change is over
TICK = os.sysconf("SC_CLK_TCK")
JOB = "bench"
KINDS = ("kill", "kill-leader", "join", "leave")

_connects = [0]
_real_connect = socket.create_connection


def _counting_connect(*args: Any, **kwargs: Any) -> socket.socket:
    if sys._getframe(1).f_globals.get("__name__") == "rendezvous.elastic.liveness":
        _connects[0] += 1  # not this benchmark's own scrapes of /metrics
    return _real_connect(*args, **kwargs)


socket.create_connection = _counting_connect  # type: ignore[assignment]

# gRPC Python's blocking calls and stream iterators wait on a condition that each
# answer notifies, but wake every 0.1 s anyway (grpc._common.MAXIMUM_WAIT_TIMEOUT, so
# that Ctrl-C is seen). A runner has two or three such threads: 30 wake-ups a second.
# A thousand members in this one process have two thousand: 20,000 wake-ups a second,
# each taking the interpreter lock, which on 2 cores starves every other thread (the
# keep-alives' included) and makes the one-process benchmark measure itself. The answers
# are delivered as before; only the idle wake-ups go.
grpc_common.MAXIMUM_WAIT_TIMEOUT = IDLE_WAKE_S

_leases_lost = [0]
_real_declare_lost = LeaseKeeper._declare_lost


def _counting_declare_lost(self: LeaseKeeper, why: str) -> None:
    if not self._closed.is_set() and not self._lost.is_set():
        _leases_lost[0] += 1  # a crashed member's keeper is closed first: not counted
    _real_declare_lost(self, why)


LeaseKeeper._declare_lost = _counting_declare_lost  # type: ignore[method-assign]


# etcd's /metrics ---------------------------------------------------------------------------


def scrape(endpoint: str) -> dict[str, float]:
    """The counters this benchmark reads, summed over their labels."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        key = base
        if base == "grpc_server_handled_total" and 'grpc_method="Txn"' in name:
            key = "txn"
        elif base not in ("etcd_server_proposals_committed_total",
                          "etcd_debugging_mvcc_events_total",
                          "etcd_network_client_grpc_sent_bytes_total"):
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


# per-thread CPU ------------------------------------------------------------------------------


def thread_cpu() -> dict[str, float]:
    """CPU seconds by live thread name (threads of one name added up)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, name in names.items():
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def member_cpu(cpu: dict[str, float], node: str) -> float:
    pattern = re.compile(rf"(^|[ /]){re.escape(node)}$")
    return sum(v for name, v in cpu.items() if pattern.search(name))


# members -------------------------------------------------------------------------------------


@dataclass
class Member:
    node: str
    handler: AssignedRendezvousHandler
    rounds: list[tuple[float, int, int]] = field(default_factory=list)  # (t, round, world)
    error: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    leaving: threading.Event = field(default_factory=threading.Event)
    tick: threading.Event = field(default_factory=threading.Event)
    left: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            self._loop()
        except BaseException:
            if not self.stop.is_set():
                self.error = traceback.format_exc()

    def _loop(self) -> None:
        handler = self.handler
        info = handler.next_rendezvous()
        self.rounds.append((time.time(), handler.current_round(), info.world_size))
        handler.set_bounds(1, 100_000)
        while not self.stop.is_set() and not self.leaving.is_set():
            if handler.pending_change() is not None:
                info = handler.next_rendezvous()
                self.rounds.append((time.time(), handler.current_round(), info.world_size))
                continue
            # The swarm's one ticker asks pending_change for every member each POLL_S
            # and wakes this thread when there is one (or a leave or stop).
            self.tick.wait()
            self.tick.clear()
        if self.stop.is_set():
            return
        handler.announce_leaving()
        deadline = time.monotonic() + CHANGE_DEADLINE_S
        while time.monotonic() < deadline and not self.stop.is_set():
            change = handler.pending_change()
            if change is not None and change.kind == "superseded":
                break
            time.sleep(POLL_S)
        handler.leave()
        self.left.set()

    def crash(self) -> None:
        """What a SIGKILL does to the member: its sockets close, its keep-alives stop.
        Nothing is revoked or deleted: etcd and the peers find out by themselves."""
        self.stop.set()
        self.tick.set()
        h: Any = self.handler
        h._stopped.set()
        leading = getattr(h, "_leading", None)
        if leading is not None:
            leading.stop()
        for part in ("_server", "_monitor"):
            obj = getattr(h, part, None)
            if obj is not None:
                obj.close()
        keeper = getattr(h._join, "_lease", None)
        if keeper is not None:
            keeper.close(revoke=False)
        for part in ("_watcher", "_leader_watcher"):
            obj = getattr(h, part, None)
            if obj is not None:
                obj.stop(timeout=5)

    def back_in(self, world: int, after: float) -> bool:
        rounds = [r for r in self.rounds if r[0] > after]
        return bool(rounds) and rounds[-1][2] == world


class Swarm:
    def __init__(self, endpoint: str, root: str) -> None:
        config = EtcdConfig(endpoints=[endpoint], root=root, timeout_s=30)
        self.clients: list[EtcdClient] = [create_client(config) for _ in range(CLIENTS)]
        self.root = root
        self.members: dict[str, Member] = {}
        self.crashed: set[str] = set()
        self.count = 0
        self._closed = threading.Event()
        threading.Thread(target=self._tick, name="ticker", daemon=True).start()

    def _tick(self) -> None:
        """What each runner's monitor loop does every POLL_S (ask ``pending_change``),
        for every member from one thread: a thousand threads waking ten times a second
        each would measure this process's scheduler, not the rendezvous."""
        while not self._closed.wait(POLL_S):
            for m in list(self.members.values()):
                # (a crash, a leave and close set the tick themselves)
                if not (m.tick.is_set() or m.stop.is_set() or m.left.is_set()) \
                        and m.handler.pending_change() is not None:
                    m.tick.set()

    def falsely_lost(self) -> set[str]:
        """Nodes a ring peer marked lost (``m/lost/<node>``) that were never killed and did
        not leave (a leaver's sockets close too: its peers' mark is true)."""
        client = self.clients[0]
        prefix = client.keys.assigned_lost_prefix(JOB)
        marks, _ = client.get_prefix(prefix)
        gone = self.crashed | {m.node for m in self.members.values() if m.left.is_set()}
        return {n for kv in marks if (n := Keys.id_under(prefix, kv.key))} - gone

    def spawn(self, n: int, first_min: int, batch: int = 64) -> list[Member]:
        """Start ``n`` members, ``batch`` at a time: each batch has put its join records
        before the next starts (as nodes that boot over a few seconds do). A thousand
        threads asking etcd at once would queue on this one process's interpreter lock
        (every waiter wakes each 5 ms to ask for it), which no real job of separate
        processes does."""
        made: list[Member] = []
        for first in range(0, n, batch):
            part = self._spawn(min(batch, n - first), first_min)
            made += part
            if n > batch:
                wait(lambda: all(m.handler._join.wanted or m.error for m in part),  # noqa: B023
                     CHANGE_DEADLINE_S, f"members {part[0].node}.. to put their join records")
        return made

    def _spawn(self, n: int, first_min: int) -> list[Member]:
        made = []
        for _ in range(n):
            node = f"m{self.count}"
            client = self.clients[self.count % len(self.clients)]
            self.count += 1
            handler = AssignedRendezvousHandler(
                client, run_id=JOB, node_id=node, addr="127.0.0.1", min_nodes=first_min,
                max_nodes=100_000, root=self.root, lease_ttl_s=LEASE_TTL_S, join_timeout_s=600,
            )
            m = Member(node, handler)
            m.thread = threading.Thread(target=m.run, name=f"member {node}", daemon=True)
            self.members[node] = m
            made.append(m)
        for m in made:
            assert m.thread is not None
            m.thread.start()
        return made

    def alive(self) -> list[Member]:
        return [m for m in self.members.values() if not m.stop.is_set() and not m.left.is_set()
                and not m.leaving.is_set()]

    def leader(self) -> Member:
        """The member that writes rounds."""
        alive = self.alive()
        for m in alive:
            if getattr(m.handler, "is_leader", lambda: False)():
                return m
        return alive[0]  # between leaders (one died, its successor not yet in): any member

    def close(self) -> None:
        self._closed.set()
        for m in self.members.values():
            m.stop.set()
            m.tick.set()
        for m in self.members.values():
            with contextlib.suppress(Exception):
                m.handler.close()
        for c in self.clients:
            c.close()


def wait(condition: Callable[[], bool], timeout: float, what: str) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    print(f"  gave up waiting for {what} after {timeout:.0f} s", flush=True)
    return False


def wait_quiet(endpoint: str, timeout: float) -> dict[str, float]:
    """etcd's write and event counters unchanged for QUIET_S (a deadline, then as is)."""
    deadline = time.monotonic() + timeout
    last = scrape(endpoint)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = scrape(endpoint)
        moved = any(now.get(k) != last.get(k) for k in
                    ("etcd_server_proposals_committed_total", "etcd_debugging_mvcc_events_total"))
        if moved:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= QUIET_S:
            return now
    return last


# one change ----------------------------------------------------------------------------------


def one_change(swarm: Swarm, endpoint: str, kind: str, n: int) -> dict[str, Any]:
    alive = swarm.alive()
    if kind == "kill-leader":
        gone: Member | None = swarm.leader()
    elif kind in ("kill", "leave"):
        leader = swarm.leader()
        gone = next(m for m in reversed(alive) if m is not leader)
    else:
        gone = None
    wait_quiet(endpoint, 30)
    before, cpu0, conn0, lost0 = scrape(endpoint), thread_cpu(), _connects[0], _leases_lost[0]
    proc0 = time.process_time()
    act = time.time()
    if kind in ("kill", "kill-leader"):
        assert gone is not None
        swarm.crashed.add(gone.node)
        gone.crash()
        stay = [m for m in alive if m is not gone]
    elif kind == "leave":
        assert gone is not None
        gone.leaving.set()
        gone.tick.set()
        stay = [m for m in alive if m is not gone]
    else:
        stay = [*alive, *swarm.spawn(1, 1)]
    world = len(stay)
    wait(lambda: all(m.back_in(world, act) or m.error for m in stay), CHANGE_DEADLINE_S,
         f"{world} members back after a {kind}")
    if kind == "leave" and gone is not None:
        wait(gone.left.is_set, 60, "the leaver to leave")
    after = wait_quiet(endpoint, 30)
    cpu1, conn1, proc1 = thread_cpu(), _connects[0], time.process_time()
    backs = [max(r[0] for r in m.rounds if r[0] > act) for m in stay if m.back_in(world, act)]
    leader = swarm.leader()
    per = [member_cpu(cpu1, m.node) - member_cpu(cpu0, m.node) for m in stay if m is not leader]

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    # World size exact: every survivor's every round since the act has the new size
    # (a member falsely lost and put back shows as a smaller round, then a larger one).
    sizes = [r[2] for m in stay for r in m.rounds if r[0] > act]

    return {
        "change": kind, "members": n, "survivors": world,
        "etcd_write_txns": delta("etcd_server_proposals_committed_total"),
        "etcd_txns": delta("txn"),
        "watch_events": delta("etcd_debugging_mvcc_events_total"),
        "etcd_bytes_out": delta("etcd_network_client_grpc_sent_bytes_total"),
        "liveness_connects": conn1 - conn0,
        "per_member_cpu_ms": round(1000 * sum(per) / max(1, len(per)), 2),
        "leader_cpu_ms": round(1000 * (member_cpu(cpu1, leader.node)
                                       - member_cpu(cpu0, leader.node)), 1),
        "process_cpu_ms": round(1000 * (proc1 - proc0), 1),
        "dropped": sum(1 for m in stay if not m.back_in(world, act) or m.error),
        "formation_s": round(max(backs) - act, 3) if backs else None,
        "leases_lost": _leases_lost[0] - lost0,
        "false_losses": len(swarm.falsely_lost()),
        "world_exact": bool(sizes) and all(size == world for size in sizes),
        "rounds_seen": max((len({r[1] for r in m.rounds if r[0] > act}) for m in stay),
                           default=0),
    }


def run_size(endpoint: str, n: int, protocol: str) -> list[dict[str, Any]]:
    swarm = Swarm(endpoint, f"/bench-{protocol}-{n}-{os.getpid()}")
    rows: list[dict[str, Any]] = []
    try:
        start = time.time()
        swarm.spawn(n, n)
        formed = wait(lambda: all(m.back_in(n, start) or m.error
                                  for m in swarm.members.values()), CHANGE_DEADLINE_S * 2,
                      f"{n} members in their first round")
        errors = [m.error for m in swarm.members.values() if m.error]
        if not formed or errors:
            print(errors[0] if errors else "no first round", flush=True)
            return rows
        print(f"{n} members formed their first round in {time.time() - start:.1f} s", flush=True)
        for kind in KINDS:
            row = {"protocol": protocol, **one_change(swarm, endpoint, kind, len(swarm.alive()))}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if row["dropped"]:
                break
    finally:
        swarm.close()
    return rows


# ten consecutive changes beside busy loops ------------------------------------------------------

SOAK_KINDS = ("kill", "join", "kill-leader", "join", "leave",
              "kill", "join", "kill-leader", "join", "leave")
SOAK_COLUMNS = ("change", "members", "leases_lost", "false_losses", "world_exact", "dropped",
                "rounds_seen", "etcd_write_txns", "watch_events", "formation_s")


@contextlib.contextmanager
def busy_loops(count: int) -> Any:
    """``count`` Python processes that each spin a CPU, stopped by process group at the end."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def run_soak(endpoint: str, n: int, busy: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Form a round of ``n`` members, then run SOAK_KINDS back to back beside ``busy`` loops.

    Every change is counted (one_change) and checked: no lease lost, no member
    falsely marked lost, every survivor's rounds of the new size only, none dropped.
    """
    swarm = Swarm(endpoint, f"/bench-soak-{n}-{os.getpid()}")
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"members": n, "busy_loops": busy}
    try:
        start = time.time()
        swarm.spawn(n, n)
        formed = wait(lambda: all(m.back_in(n, start) or m.error
                                  for m in swarm.members.values()), CHANGE_DEADLINE_S * 2,
                      f"{n} members in their first round")
        summary["first_round_s"] = round(time.time() - start, 1)
        errors = [m.error for m in swarm.members.values() if m.error]
        if not formed or errors:
            summary["failed"] = errors[0] if errors else "no first round"
            return rows, summary
        print(f"{n} members formed their first round in {summary['first_round_s']} s", flush=True)
        with busy_loops(busy) as pids:
            summary["busy_pids"] = pids
            for kind in SOAK_KINDS:
                row = one_change(swarm, endpoint, kind, len(swarm.alive()))
                print(json.dumps(row), flush=True)
                rows.append(row)
                if row["dropped"]:
                    break
            summary["load_average"] = os.getloadavg()
    finally:
        swarm.close()
    summary.update(
        changes=len(rows),
        leases_lost=sum(r["leases_lost"] for r in rows),
        false_losses=max((r["false_losses"] for r in rows), default=0),
        world_exact=bool(rows) and all(r["world_exact"] for r in rows),
        dropped=sum(r["dropped"] for r in rows),
    )
    return rows, summary


COLUMNS = ("protocol", "change", "members", "etcd_write_txns", "watch_events", "etcd_bytes_out",
           "liveness_connects", "per_member_cpu_ms", "leader_cpu_ms", "dropped", "formation_s")


def table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "-")) for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    global CHANGE_DEADLINE_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--protocol", default="leader",
                        help="a label for the rows: the protocol of the checked-out code")
    parser.add_argument("--out", type=Path, default=Path("build/bench-scale.json"))
    parser.add_argument("--soak", type=int, default=0, metavar="N",
                        help="instead: ten consecutive changes at N members beside busy loops")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside --soak")
    parser.add_argument("--deadline", type=float, default=CHANGE_DEADLINE_S,
                        help="seconds a change may take (the first round: twice that)")
    args = parser.parse_args(argv)
    CHANGE_DEADLINE_S = args.deadline
    if args.soak:
        with EtcdServer() as etcd:
            soak_rows, summary = run_soak(etcd.endpoint, args.soak, args.busy)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        soak_meta = {"cores": os.cpu_count(), "lease_ttl_s": LEASE_TTL_S}
        args.out.write_text(json.dumps({"meta": soak_meta, "summary": summary,
                                        "rows": soak_rows}, indent=1))
        print(table(soak_rows, SOAK_COLUMNS))
        print(json.dumps(summary))
        return
    rows: list[dict[str, Any]] = []
    with EtcdServer() as etcd:
        for n in (int(x) for x in args.nodes.split(",") if x):
            rows += run_size(etcd.endpoint, n, args.protocol)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"load_average": os.getloadavg(), "cores": os.cpu_count(), "lease_ttl_s": LEASE_TTL_S}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # daemon threads of crashed members: do not wait for them
