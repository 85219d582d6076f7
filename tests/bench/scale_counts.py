"""The count benchmark: what one rendezvous round costs, counted exactly, against N (issue #24).

``python -m tests.bench.scale_counts --nodes 8,64,256,1024 --out build/bench-scale.json``
(``make bench-scale``) runs N members of the agents' rendezvous
(:class:`~rendezvous.elastic.assigned.AssignedRendezvousHandler`) on a real etcd (its own,
on a free loopback port) with real sockets, spread over ``--procs`` worker processes
(:mod:`tests.bench.scale_member`: each hosts its share as threads, with the handler's own
watches, leases and liveness sockets; members are dealt to the workers in turn). This
process starts etcd and the workers, makes each change and collects the counts; it hosts
no member. ``--procs 0`` (the default) takes one worker per 128 members: one process of a
thousand members (about 6,000 threads behind one interpreter lock) starves its own
keep-alives on 2 cores (docs/benchmarks.md).

For each change (``kill``: a member's sockets close and its keep-alives stop, as
when its process dies; ``kill-leader``: the same for the member that writes rounds;
``join``: a new member, on the worker with the fewest; ``leave``: a planned leave,
``announce_leaving`` then ``leave``) one row, counted between the act and the moment
every survivor is back from ``next_rendezvous`` in a round of the right size and
etcd has gone quiet:

* ``etcd_write_txns``: raft proposals etcd committed (every put, delete, transaction
  with a write, whether its compare held or not, lease grant and revoke;
  ``etcd_server_proposals_committed_total``); ``etcd_txns``: Txn calls handled;
* ``watch_events``: events etcd sent to watchers (``etcd_debugging_mvcc_events_total``);
* ``etcd_bytes_out``: bytes etcd sent to clients
  (``etcd_network_client_grpc_sent_bytes_total``; keep-alive answers included);
  etcd's counters are global: they need nothing from the workers;
* ``liveness_connects``: TCP connections the members' liveness code opened
  (``socket.create_connection`` called from :mod:`rendezvous.elastic.liveness`), summed
  over the workers;
* ``per_member_cpu_ms`` (mean over the survivors but the leader) and ``leader_cpu_ms``:
  CPU of each member's threads (their names end in the node id), from each worker's
  ``/proc/self/task``; ``process_cpu_ms``: the workers' CPU (gRPC's own threads too);
* ``leases_lost``: keepers that declared their lease lost (a crashed member's not counted);
* ``keepalive`` (per worker process, over the change) and ``keepalive_run`` (since the
  worker started): where its keep-alives' time went (``rendezvous.lease.KeepAliveTrace``):
  how late each was sent after it was due (``send_late_ms``), sent to answered
  (``answer_ms``), how late the sending thread woke from its timed sleeps, how late a
  thread that sleeps 50 ms woke (``probe_late_ms``: the process's own starvation, CPU and
  interpreter lock), and each lease given up: whether its last keep-alive was in flight or
  never sent, and whether etcd still held it when asked afterwards (``lost_still_on_etcd``);
* ``dropped``: survivors not back in the round of the right size by the deadline, or
  whose handler failed; ``world_exact``: every survivor's every round since the act has
  the new size; ``formation_s``: the act to the last survivor back.

``--soak N`` runs instead ten
consecutive changes at N members beside ``--busy`` (2) Python processes that each spin a
CPU (started and stopped here, by process group), and checks each: ``leases_lost``,
``false_losses`` (``m/lost/`` marks of members neither killed nor gone by a leave),
``world_exact`` and ``dropped``.

Wall times on a shared 2-core machine measure contention more than the protocol; the
counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.keys import Keys
from tests.bench.scale_member import JOB, LEASE_TTL_S

CHANGE_DEADLINE_S = 300.0
QUIET_S = 0.5  # etcd's proposals and events unchanged this long: the change is over
SETTLE_S = 120.0  # how long a change waits for every member to be in one round, none pending
PER_PROC = 128  # members per worker when --procs is 0
CHANNELS = 16  # gRPC channels in all, shared out over the workers (at least 4 each)
BATCH = 64  # members started at a time, each batch's join records put before the next
KINDS = ("kill", "kill-leader", "join", "leave")
REPO = Path(__file__).resolve().parents[2]


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
        method = name.split('grpc_method="', 1)[-1].split('"', 1)[0]
        if "etcdserverpb" in name and base == "grpc_server_handled_total":
            key = f"calls:{method}"  # calls handled, by method (every status code)
        elif "etcdserverpb" in name and base == "grpc_server_msg_sent_total":
            key = f"sent:{method}"  # messages sent, by method (a watch event batch is one)
        elif base not in ("etcd_server_proposals_committed_total",
                          "etcd_debugging_mvcc_events_total",
                          "etcd_network_client_grpc_sent_bytes_total"):
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


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


# the workers ---------------------------------------------------------------------------------


def task_states(pid: int) -> dict[str, int]:
    """How many threads of process ``pid`` are in each state (R, S, D...), from /proc."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                state = stat.rsplit(")", 1)[1].split()[0]
                out[state] = out.get(state, 0) + 1
    return out


class WorkerProc:
    """One worker process (tests/bench/scale_member.py) and its command pipe."""

    def __init__(self, endpoint: str, root: str, clients: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.scale_member", "--endpoint", endpoint,
             "--root", root, "--clients", str(clients)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
            start_new_session=True,
        )
        self.nodes: list[str] = []

    def send(self, op: str, **args: Any) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, **args}) + "\n")
        stdin.flush()

    def reply(self) -> dict[str, Any]:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited (status {self.proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "failed" in answer:
            raise RuntimeError(f"worker {self.proc.pid}: {answer['failed']}")
        return answer

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.send("close")
            self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class Fleet:
    """The members, dealt to ``procs`` worker processes; what the parent knows of them."""

    def __init__(self, endpoint: str, root: str, procs: int) -> None:
        self.root = root
        clients = max(4, CHANNELS // procs)
        self.workers: list[WorkerProc] = []
        try:
            for _ in range(procs):
                self.workers.append(WorkerProc(endpoint, root, clients))
        except BaseException:
            self.close()
            raise
        self.where: dict[str, WorkerProc] = {}
        self.order: list[str] = []  # nodes in the order they were started
        self.crashed: set[str] = set()
        self.leaving: set[str] = set()
        self.left: set[str] = set()
        self.count = 0
        self.client = create_client(EtcdConfig(endpoints=[endpoint], root=root, timeout_s=30))

    def all(self, op: str, args: dict[WorkerProc, dict[str, Any]] | None = None,
            **common: Any) -> dict[WorkerProc, dict[str, Any]]:
        """``op`` on every worker (or those in ``args``, each with its own arguments) at once."""
        targets = args if args is not None else {w: {} for w in self.workers}
        for w, own in targets.items():
            w.send(op, **common, **own)
        return {w: w.reply() for w in targets}

    def spawn(self, n: int, first_min: int) -> list[str]:
        """Start ``n`` members, BATCH at a time, dealt in turn to the workers (one member:
        on the worker with the fewest); each batch has put its join records before the
        next starts (as nodes that boot over a few seconds do)."""
        made: list[str] = []
        for first in range(0, n, BATCH):
            share: dict[WorkerProc, list[str]] = {}
            for _ in range(min(BATCH, n - first)):
                node = f"m{self.count}"
                self.count += 1
                worker = min(self.workers, key=lambda w: len(w.nodes))
                worker.nodes.append(node)
                self.where[node] = worker
                self.order.append(node)
                share.setdefault(worker, []).append(node)
                made.append(node)
            replies = self.all("spawn", {w: {"nodes": nodes} for w, nodes in share.items()},
                               first_min=first_min, timeout=CHANGE_DEADLINE_S)
            errors = [r["error"] for r in replies.values() if r["error"]]
            if errors:
                raise RuntimeError(f"a member failed to start: {errors[0]}")
        return made

    def alive(self) -> list[str]:
        gone = self.crashed | self.leaving | self.left
        return [n for n in self.order if n not in gone]

    def leader(self) -> str:
        """The member that writes rounds (between leaders: the first alive)."""
        alive = set(self.alive())
        for reply in self.all("leader").values():
            if reply["node"] in alive:
                return str(reply["node"])
        return self.alive()[0]

    def crash(self, node: str) -> None:
        self.crashed.add(node)
        self.where[node].call("crash", node=node)

    def leave(self, node: str) -> None:
        self.leaving.add(node)
        self.where[node].call("leave", node=node)

    def wait_left(self, node: str, timeout: float) -> None:
        if self.where[node].call("wait_left", node=node, timeout=timeout)["left"]:
            self.leaving.discard(node)
            self.left.add(node)

    def wait_back(self, stay: list[str], world: int, after: float,
                  timeout: float) -> dict[str, Any]:
        """Every worker waits for its share of ``stay``; the answers summed up."""
        share: dict[WorkerProc, dict[str, Any]] = {}
        for node in stay:
            share.setdefault(self.where[node], {"nodes": []})["nodes"].append(node)
        stop = threading.Event()
        watcher = threading.Thread(target=self._report, args=(stop,), daemon=True)
        watcher.start()
        try:
            replies = list(self.all("wait_back", share, world=world, after=after,
                                    timeout=timeout).values())
        finally:
            stop.set()
        backs = [r["last_back"] for r in replies if r["last_back"] is not None]
        return {
            "back": sum(r["back"] for r in replies),
            "last_back": max(backs, default=None),
            "dropped": sum(r["dropped"] for r in replies),
            "world_exact": all(r["sizes_exact"] for r in replies)
            and sum(r["sizes"] for r in replies) > 0,
            "rounds_seen": max(r["rounds_seen"] for r in replies),
            "round_sizes": sorted({tuple(x) for r in replies for x in r["round_sizes"]}),
            "error": next((r["error"] for r in replies if r["error"]), None),
        }

    def _report(self, stop: threading.Event) -> None:
        """Every 30 s of a wait: the load and where each worker's threads are."""
        start = time.monotonic()
        while not stop.wait(30):
            states = [task_states(w.proc.pid) for w in self.workers]
            print(f"  {time.monotonic() - start:.0f} s: load {os.getloadavg()[0]:.0f}, "
                  f"threads by state per worker {states}", flush=True)

    def settle(self, timeout: float) -> bool:
        """Wait until every living member is in the same round and none sees a change
        (the last change's stragglers, a lease lost and put back): each change starts
        from a round that holds. False: not by ``timeout``, the change goes ahead."""
        deadline = time.monotonic() + timeout
        while True:
            share: dict[WorkerProc, dict[str, Any]] = {w: {"nodes": []} for w in self.workers}
            for node in self.alive():
                share[self.where[node]]["nodes"].append(node)
            replies = self.all("rounds", share).values()
            rounds = {r for reply in replies for r in reply["rounds"]}
            if len(rounds) == 1 and not any(reply["pending"] for reply in replies):
                return True
            if time.monotonic() > deadline:
                print(f"  not settled after {timeout:.0f} s: rounds {sorted(rounds)}, "
                      f"{sum(r['pending'] for r in replies)} members see a change", flush=True)
                return False
            time.sleep(0.5)

    def falsely_lost(self) -> set[str]:
        """Nodes a ring peer marked lost (``m/lost/<node>``) that were never killed and did
        not leave (a leaver's sockets close too: its peers' mark is true)."""
        prefix = self.client.keys.assigned_lost_prefix(JOB)
        marks, _ = self.client.get_prefix(prefix)
        gone = self.crashed | self.leaving | self.left
        return {n for kv in marks if (n := Keys.id_under(prefix, kv.key))} - gone

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        with contextlib.suppress(AttributeError):
            self.client.close()


# one change ----------------------------------------------------------------------------------


def one_change(fleet: Fleet, endpoint: str, kind: str, n: int) -> dict[str, Any]:
    alive = fleet.alive()
    if kind == "kill-leader":
        gone: str | None = fleet.leader()
    elif kind in ("kill", "leave"):
        leader = fleet.leader()
        gone = next(m for m in reversed(alive) if m != leader)
    else:
        gone = None
    settled = fleet.settle(SETTLE_S)
    wait_quiet(endpoint, 30)
    fleet.all("mark")
    before = scrape(endpoint)
    act = time.time()
    if kind in ("kill", "kill-leader"):
        assert gone is not None
        fleet.crash(gone)
        stay = [m for m in alive if m != gone]
    elif kind == "leave":
        assert gone is not None
        fleet.leave(gone)
        stay = [m for m in alive if m != gone]
    else:
        stay = [*alive, *fleet.spawn(1, 1)]
    world = len(stay)
    back = fleet.wait_back(stay, world, act, CHANGE_DEADLINE_S)
    if back["back"] < world:
        print(f"  {back['back']} of {world} members back after a {kind}", flush=True)
    if kind == "leave" and gone is not None:
        fleet.wait_left(gone, 60)
    after = wait_quiet(endpoint, 30)
    leader = fleet.leader()
    measured = fleet.all("measure", {w: {"nodes": [m for m in stay if fleet.where[m] is w]}
                                     for w in fleet.workers})
    cpu = {node: ms for r in measured.values() for node, ms in r["cpu_ms"].items()}
    per = [ms for node, ms in cpu.items() if node != leader]

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    def by_method(kind: str) -> dict[str, int]:
        return {k.split(":", 1)[1]: d for k in after if k.startswith(kind) and (d := delta(k))}

    return {
        "change": kind, "members": n, "survivors": world, "procs": len(fleet.workers),
        "etcd_write_txns": delta("etcd_server_proposals_committed_total"),
        "etcd_txns": delta("calls:Txn"),
        "etcd_calls": by_method("calls:"),
        "etcd_msgs_sent": by_method("sent:"),
        "watch_events": delta("etcd_debugging_mvcc_events_total"),
        "etcd_bytes_out": delta("etcd_network_client_grpc_sent_bytes_total"),
        "liveness_connects": sum(r["connects"] for r in measured.values()),
        "per_member_cpu_ms": round(sum(per) / max(1, len(per)), 2),
        "leader_cpu_ms": round(cpu.get(leader, 0.0), 1),
        "process_cpu_ms": round(sum(r["process_cpu_ms"] for r in measured.values()), 1),
        "threads": sum(r["threads"] for r in measured.values()),
        "dropped": back["dropped"],
        "formation_s": round(back["last_back"] - act, 3) if back["last_back"] else None,
        "leases_lost": sum(r["leases_lost"] for r in measured.values()),
        "false_losses": len(fleet.falsely_lost()),
        "world_exact": back["world_exact"],
        "rounds_seen": back["rounds_seen"],
        "round_sizes": back["round_sizes"],
        "error": back["error"],
        "load_average": round(os.getloadavg()[0], 1),
        "settled_before": settled,
        # per worker process: where its keep-alives' time went (scale_member.keepalive_report)
        "keepalive": [r["keepalive"] for r in measured.values()],
        "keepalive_run": [r["keepalive_run"] for r in measured.values()],
        **keepalive_columns([r["keepalive"] for r in measured.values()]),
    }


def keepalive_columns(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' keep-alive reports in a few columns: the worst answer, send and
    50-ms-sleeper lateness of any worker, and how the leases given up were lost."""
    return {
        "ka_answer_max_ms": max((r["answer_ms"]["max"] for r in reports), default=0.0),
        "ka_send_late_max_ms": max((r["send_late_ms"]["max"] for r in reports), default=0.0),
        "probe_late_max_ms": max((r["probe_late_ms"]["max"] for r in reports), default=0.0),
        "lost_in_flight": sum(r["lost_in_flight"] for r in reports),
        "lost_unsent": sum(r["lost_unsent"] for r in reports),
        "lost_still_on_etcd": sum(r["lost_still_on_etcd"] for r in reports),
    }


def first_round(fleet: Fleet, n: int) -> tuple[float, str | None]:
    """Start ``n`` members and wait for their first round: (seconds, why it failed)."""
    start = time.time()
    fleet.spawn(n, n)
    back = fleet.wait_back(fleet.alive(), n, start, CHANGE_DEADLINE_S * 2)
    took = round(time.time() - start, 1)
    if back["back"] < n or back["error"]:
        return took, back["error"] or f"{back['back']} of {n} members in the first round"
    return took, None


def procs_for(n: int, procs: int) -> int:
    return procs or math.ceil(n / PER_PROC)


def run_size(endpoint: str, n: int, protocol: str, procs: int) -> list[dict[str, Any]]:
    fleet = Fleet(endpoint, f"/bench-{protocol}-{n}-{os.getpid()}", procs_for(n, procs))
    rows: list[dict[str, Any]] = []
    try:
        took, failed = first_round(fleet, n)
        if failed:
            print(f"{n} members: {failed} after {took} s", flush=True)
            return rows
        print(f"{n} members in {len(fleet.workers)} processes formed their first round "
              f"in {took} s", flush=True)
        for kind in KINDS:
            row = {"protocol": protocol, **one_change(fleet, endpoint, kind, len(fleet.alive()))}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if row["dropped"]:
                break
    finally:
        fleet.close()
    return rows


# ten consecutive changes beside busy loops ------------------------------------------------------

SOAK_KINDS = ("kill", "join", "kill-leader", "join", "leave",
              "kill", "join", "kill-leader", "join", "leave")
SOAK_COLUMNS = ("change", "members", "leases_lost", "false_losses", "world_exact", "dropped",
                "rounds_seen", "etcd_write_txns", "watch_events", "formation_s",
                "load_average", "ka_answer_max_ms", "ka_send_late_max_ms", "probe_late_max_ms",
                "lost_in_flight", "lost_unsent", "lost_still_on_etcd")


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


def run_soak(endpoint: str, n: int, busy: int,
             procs: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Form a round of ``n`` members, then run SOAK_KINDS back to back beside ``busy`` loops.

    Every change is counted (one_change) and checked: no lease lost, no member
    falsely marked lost, every survivor's rounds of the new size only, none dropped.
    """
    fleet = Fleet(endpoint, f"/bench-soak-{n}-{os.getpid()}", procs_for(n, procs))
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"members": n, "busy_loops": busy, "procs": len(fleet.workers)}
    try:
        summary["first_round_s"], failed = first_round(fleet, n)
        if failed:
            summary["failed"] = failed
            return rows, summary
        print(f"{n} members formed their first round in {summary['first_round_s']} s", flush=True)
        with busy_loops(busy) as pids:
            summary["busy_pids"] = pids
            for kind in SOAK_KINDS:
                row = one_change(fleet, endpoint, kind, len(fleet.alive()))
                print(json.dumps(row), flush=True)
                rows.append(row)
                if row["dropped"]:
                    break
            summary["load_average"] = os.getloadavg()
    finally:
        fleet.close()
    summary.update(
        changes=len(rows),
        leases_lost=sum(r["leases_lost"] for r in rows),
        false_losses=max((r["false_losses"] for r in rows), default=0),
        world_exact=bool(rows) and all(r["world_exact"] for r in rows),
        dropped=sum(r["dropped"] for r in rows),
    )
    return rows, summary


COLUMNS = ("protocol", "change", "members", "procs", "etcd_write_txns", "watch_events",
           "etcd_bytes_out", "liveness_connects", "per_member_cpu_ms", "leader_cpu_ms",
           "leases_lost", "dropped", "world_exact", "formation_s")


def table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "-")) for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    global CHANGE_DEADLINE_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--procs", type=int, default=0,
                        help=f"worker processes hosting the members (0: one per {PER_PROC})")
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
    meta: dict[str, Any] = {"cores": os.cpu_count(), "lease_ttl_s": LEASE_TTL_S,
                            "load_average_start": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.soak:
        with EtcdServer() as etcd:
            soak_rows, summary = run_soak(etcd.endpoint, args.soak, args.busy, args.procs)
        args.out.write_text(json.dumps({"meta": meta, "summary": summary,
                                        "rows": soak_rows}, indent=1))
        print(table(soak_rows, SOAK_COLUMNS))
        print(json.dumps(summary))
        return
    rows: list[dict[str, Any]] = []
    with EtcdServer() as etcd:
        for n in (int(x) for x in args.nodes.split(",") if x):
            rows += run_size(etcd.endpoint, n, args.protocol, args.procs)
            meta["load_average"] = os.getloadavg()
            args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
