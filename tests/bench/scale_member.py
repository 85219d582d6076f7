"""The members of the count benchmark, and the worker process that hosts a share of them (#24).

``python -m tests.bench.scale_member --endpoint HOST:PORT --root /bench-...`` is one worker
of :mod:`tests.bench.scale_counts`: it hosts the members the parent names, as threads of
this process, each an :class:`~rendezvous.elastic.assigned.AssignedRendezvousHandler` with
its own watches, lease and liveness sockets (the members share a few etcd clients, gRPC
channels), and does to them what the parent asks. Each member does what a runner does with
its handler (tests/support/rdzv_swarm.py): ask ``pending_change`` every 0.1 s (one ticker
thread asks for every member of the process and wakes the member's thread when there is a
change), join the next round when there is one.

The protocol: the parent writes one JSON object a line on the worker's stdin (``{"op": ...}``)
and reads one JSON object a line back from the worker's stdout, in order; everything else the
worker prints goes to stderr (its stdout is moved to a private descriptor first). Operations:
``spawn`` (start members by name, and wait until their join records are put), ``wait_back``
(wait until the named members are back in a round of a given size after a given time, and
say how), ``rounds`` (the named members' rounds, and how many see a change), ``leader``,
``mark`` / ``measure`` (this process's counters before and after a
change: CPU by member from ``/proc/self/task``, liveness connects, leases lost), ``crash``,
``leave``, ``wait_left`` and ``close``.

Several workers are how 1,024 members fit 2 cores: one process of a thousand members holds
about 6,000 threads behind one interpreter lock, and its keep-alives starve (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from grpc import _common as grpc_common

from rendezvous.elastic.assigned import AssignedRendezvousHandler
from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.lease import KeepAlives, KeepAliveTrace, LeaseKeeper

POLL_S = 0.1  # agent/runner/elastic.py's monitor_interval
IDLE_WAKE_S = 5.0  # how often a thread blocked on gRPC wakes with nothing to do (below)
LEASE_TTL_S = 10
JOB = "bench"
TICK = os.sysconf("SC_CLK_TCK")

_connects = [0]
_real_connect = socket.create_connection


def _counting_connect(*args: Any, **kwargs: Any) -> socket.socket:
    if sys._getframe(1).f_globals.get("__name__") == "rendezvous.elastic.liveness":
        _connects[0] += 1
    return _real_connect(*args, **kwargs)


socket.create_connection = _counting_connect  # type: ignore[assignment]

# gRPC Python's blocking calls and stream iterators wait on a condition that each
# answer notifies, but wake every 0.1 s anyway (grpc._common.MAXIMUM_WAIT_TIMEOUT, so
# that Ctrl-C is seen). A runner has two or three such threads: 30 wake-ups a second.
# Hundreds of members in one process have a thousand: each wake-up takes the interpreter
# lock, which on 2 cores starves every other thread (the keep-alives' included) and makes
# the benchmark measure itself. The answers are delivered as before; only the idle
# wake-ups go.
grpc_common.MAXIMUM_WAIT_TIMEOUT = IDLE_WAKE_S

_leases_lost = [0]
_real_declare_lost = LeaseKeeper._declare_lost
# Where each keep-alive's time went in this process (rendezvous.lease.KeepAliveTrace), and
# for each lease this process gave up on, what etcd said of it afterwards: (lease, TTL
# left; -1: gone). A lease etcd still held was given up by this process's clock alone.
_trace = KeepAlives.trace = KeepAliveTrace()
_lost_on_etcd: list[tuple[int, int]] = []
# How late this process's threads get the CPU and the interpreter lock: a thread that
# sleeps PROBE_S and records how much longer it slept, (when it woke, lateness).
PROBE_S = 0.05
_probe: list[tuple[float, float]] = []


def _probe_loop() -> None:
    while True:
        meant = time.monotonic() + PROBE_S
        time.sleep(PROBE_S)
        woke = time.monotonic()
        _probe.append((woke, woke - meant))


def _ask_etcd(client: EtcdClient, lease: int) -> None:
    try:
        _lost_on_etcd.append((lease, client.lease_ttl(lease)))
    except Exception:  # (etcd busy: not known)
        _lost_on_etcd.append((lease, -2))


def _counting_declare_lost(self: LeaseKeeper, why: str) -> None:
    if not self._closed.is_set() and not self._lost.is_set():
        _leases_lost[0] += 1  # a crashed member's keeper is closed first: not counted
        if why.startswith("no keep-alive"):
            threading.Thread(target=_ask_etcd, args=(self._client, self.lease_id),
                             daemon=True).start()
    _real_declare_lost(self, why)


def _quantiles(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``values`` in milliseconds (0 when empty)."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": round(1000 * at(0.5), 1), "p99": round(1000 * at(0.99), 1),
            "max": round(1000 * ordered[-1], 1)}


def keepalive_report(mark: tuple[int, int, int, int, int, int]) -> dict[str, Any]:
    """Where this process's keep-alives' time went since ``mark`` (the lengths of the
    trace's lists, the probe's and the etcd checks' then)."""
    sends, answers, wakes, losses, probe, checks = mark
    t = _trace
    lost = t.losses[losses:]
    on_etcd = _lost_on_etcd[checks:]
    return {
        "sent": len(t.sends) - sends,
        "send_late_ms": _quantiles([max(0.0, sent - due) for _, due, sent in t.sends[sends:]]),
        "answer_ms": _quantiles([answered - sent for _, sent, answered, _ in t.answers[answers:]]),
        "sender_wake_late_ms": _quantiles([woke - meant for meant, woke in t.wakes[wakes:]]),
        "probe_late_ms": _quantiles([late for _, late in _probe[probe:]]),
        "losses": len(lost),
        # the keep-alive that would have kept it was sent and not answered in time / not sent
        "lost_in_flight": sum(1 for loss in lost if loss[3] is not None),
        "lost_unsent": sum(1 for loss in lost if loss[3] is None),
        "lost_answer_age_s": _quantiles([loss[1] - loss[5] for loss in lost if loss[5]]),
        "lost_in_flight_for_s": _quantiles([loss[1] - loss[3] for loss in lost
                                            if loss[3] is not None]),
        "lost_still_on_etcd": sum(1 for _, ttl in on_etcd if ttl > 0),
        "lost_gone_on_etcd": sum(1 for _, ttl in on_etcd if ttl == -1),
    }


def trace_mark() -> tuple[int, int, int, int, int, int]:
    t = _trace
    return (len(t.sends), len(t.answers), len(t.wakes), len(t.losses), len(_probe),
            len(_lost_on_etcd))


LeaseKeeper._declare_lost = _counting_declare_lost  # type: ignore[method-assign]


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


def wait(condition: Callable[[], bool], timeout: float, what: str) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    print(f"  [{os.getpid()}] gave up waiting for {what} after {timeout:.0f} s",
          file=sys.stderr, flush=True)
    return False


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
            # The process's one ticker asks pending_change for every member each POLL_S
            # and wakes this thread when there is one (or a leave or stop).
            self.tick.wait()
            self.tick.clear()
        if self.stop.is_set():
            return
        handler.announce_leaving()
        deadline = time.monotonic() + 300
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
    """This process's members, on ``clients`` shared etcd clients, and their ticker."""

    def __init__(self, endpoint: str, root: str, clients: int) -> None:
        config = EtcdConfig(endpoints=[endpoint], root=root, timeout_s=30)
        self.clients: list[EtcdClient] = [create_client(config) for _ in range(clients)]
        self.root = root
        self.members: dict[str, Member] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._tick, name="ticker", daemon=True).start()

    def _tick(self) -> None:
        """What each runner's monitor loop does every POLL_S (ask ``pending_change``),
        for every member from one thread: hundreds of threads waking ten times a second
        each would measure this process's scheduler, not the rendezvous."""
        while not self._closed.wait(POLL_S):
            for m in list(self.members.values()):
                # (a crash, a leave and close set the tick themselves)
                if not (m.tick.is_set() or m.stop.is_set() or m.left.is_set()) \
                        and m.handler.pending_change() is not None:
                    m.tick.set()

    def spawn(self, nodes: list[str], first_min: int, timeout: float) -> str | None:
        """Start members ``nodes`` and wait until each has put its join record (or failed).

        Returns the first member's error, if one failed.
        """
        made = []
        for node in nodes:
            client = self.clients[len(self.members) % len(self.clients)]
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
        wait(lambda: all(m.handler._join.wanted or m.error for m in made), timeout,
             f"members {nodes[0]}.. to put their join records")
        return next((m.error for m in made if m.error), None)

    def wait_back(self, nodes: list[str], world: int, after: float,
                  timeout: float) -> dict[str, Any]:
        """Wait until every member of ``nodes`` is back in a round of ``world`` since
        ``after`` (or failed, or ``timeout``), and say how each came back."""
        stay = [self.members[n] for n in nodes]
        deadline = time.monotonic() + timeout
        report = time.monotonic() + 30
        while time.monotonic() < deadline:
            back = sum(1 for m in stay if m.back_in(world, after) or m.error)
            if back == len(stay):
                break
            if time.monotonic() > report:
                report += 30
                print(f"  [{os.getpid()}] {back}/{len(stay)} back in a round of {world}, "
                      f"{threading.active_count()} threads, leases lost {_leases_lost[0]}",
                      file=sys.stderr, flush=True)
            time.sleep(0.05)
        stuck = [m for m in stay if not m.back_in(world, after) and not m.error]
        if stuck:  # where the first few wait, and what their handler knows
            frames = sys._current_frames()
            for m in stuck[:3]:
                h: Any = m.handler
                thread = m.thread
                stack = frames.get(thread.ident) if thread is not None and thread.ident else None
                print(f"  [{os.getpid()}] {m.node} not back: mine {h._mine}, state "
                      f"{h._state}, checked {h._checked}, latest {h._latest}, lost {h._lost}, "
                      f"round_rev {h._round_rev}, wanted {h._join.wanted}\n"
                      + "".join(traceback.format_stack(stack) if stack else ["(no stack)"]),
                      file=sys.stderr, flush=True)
        backs = [max(r[0] for r in m.rounds if r[0] > after) for m in stay
                 if m.back_in(world, after)]
        sizes = [r[2] for m in stay for r in m.rounds if r[0] > after]
        errors = [m.error for m in stay if m.error]
        return {
            "back": len(backs),
            "last_back": max(backs, default=None),
            "dropped": sum(1 for m in stay if not m.back_in(world, after) or m.error),
            "sizes_exact": all(size == world for size in sizes),
            "sizes": len(sizes),
            "round_sizes": sorted({(r[1], r[2]) for m in stay for r in m.rounds if r[0] > after}),
            "rounds_seen": max((len({r[1] for r in m.rounds if r[0] > after}) for m in stay),
                               default=0),
            "error": errors[0] if errors else None,
        }

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


class Worker:
    """Answers the parent's operations on this process's Swarm (the module docstring)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self._mark: tuple[dict[str, float], int, int, float] = ({}, 0, 0, 0.0)
        self._trace_mark = trace_mark()

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        swarm = self.swarm
        if op == "spawn":
            return {"error": swarm.spawn(args["nodes"], args["first_min"], args["timeout"])}
        if op == "wait_back":
            return swarm.wait_back(args["nodes"], args["world"], args["after"], args["timeout"])
        if op == "leader":
            return {"node": next((m.node for m in swarm.members.values()
                                  if not m.stop.is_set() and m.handler.is_leader()), None)}
        if op == "rounds":
            members = [swarm.members[n] for n in args["nodes"]]
            return {"rounds": sorted({m.handler.current_round() for m in members}),
                    "pending": sum(1 for m in members if m.handler.pending_change() is not None)}
        if op == "mark":
            self._mark = (thread_cpu(), _connects[0], _leases_lost[0], time.process_time())
            self._trace_mark = trace_mark()
            return {}
        if op == "measure":
            cpu0, conn0, lost0, proc0 = self._mark
            cpu1 = thread_cpu()
            return {
                "cpu_ms": {n: 1000 * (member_cpu(cpu1, n) - member_cpu(cpu0, n))
                           for n in args["nodes"]},
                "connects": _connects[0] - conn0, "leases_lost": _leases_lost[0] - lost0,
                "process_cpu_ms": 1000 * (time.process_time() - proc0),
                "threads": threading.active_count(),
                "keepalive": keepalive_report(self._trace_mark),
                "keepalive_run": keepalive_report((0, 0, 0, 0, 0, 0)),
            }
        member = swarm.members.get(args.get("node", ""))
        if op == "crash" and member is not None:
            member.crash()
            return {}
        if op == "leave" and member is not None:
            member.leaving.set()
            member.tick.set()
            return {}
        if op == "wait_left" and member is not None:
            return {"left": wait(member.left.is_set, args["timeout"], "the leaver to leave")}
        raise ValueError(f"unknown operation {op!r} (args {args})")


def serve(swarm: Swarm, commands: TextIO, replies: TextIO) -> None:
    worker = Worker(swarm)
    for line in commands:
        request = json.loads(line)
        op = request.pop("op")
        if op == "close":
            swarm.close()
            replies.write("{}\n")
            replies.flush()
            return
        try:
            reply = worker.handle(op, request)
        except Exception:  # the parent reports it and stops the run
            reply = {"failed": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--clients", type=int, default=16, help="gRPC channels the members share")
    args = parser.parse_args(argv)
    # Replies go on a private copy of stdout; anything else printed goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    threading.Thread(target=_probe_loop, name="sched-probe", daemon=True).start()
    serve(Swarm(args.endpoint, args.root, args.clients), sys.stdin, replies)


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # daemon threads of crashed members: do not wait for them
