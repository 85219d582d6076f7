"""Many rendezvous members, or many torch workers, forked from one parent (bench_scale).

``python -m tests.support.rdzv_swarm members ENDPOINT ROOT JOB OUTDIR`` reads
``spawn MIN NODE...`` lines on stdin and forks one member per node: a process
of its own with its own etcd client and
:class:`~rendezvous.elastic.assigned.AssignedRendezvousHandler` (no expected nodes;
its first round waits for MIN nodes, later ones for 1: a swarm started
together forms one round), that does what a tidal runner does with it: joins, asks
:meth:`~rendezvous.elastic.assigned.AssignedRendezvousHandler.pending_change` every
0.1 s (the runner's monitor interval) and joins the next round when there is
one. SIGTERM is a planned leave: the member announces it, waits for the others'
next round and leaves. It prints ``pid NODE PID`` for each member, and each
member appends JSON lines to ``OUTDIR/NODE.jsonl``: ``{"ev", "t": time.time(),
...}`` with ev ``joining`` (before its first round), ``round`` (round, world),
``noticed`` (kind, nodes), ``announced``, ``left`` and ``failed`` (error: the
traceback of a member that died of an exception).

``python -m tests.support.rdzv_swarm workers N PORT OUTDIR`` forks N torch
workers that form a gloo group of world size N on 127.0.0.1:PORT, build DDP
around a tiny model, receive rank 0's state and step once; then destroy the
group and form it again on PORT+1 the same way (a live resize's re-init at an
unchanged size). Each writes ``OUTDIR/<rank>.json`` with the seconds of each
part; the parent, having imported what a zygote imports, writes its CPU
seconds so far to ``OUTDIR/parent.json``. It exits once every worker did.

The parent imports torch and the rendezvous once, before any thread, socket
or etcd channel exists, so a forked child starts in milliseconds: what the
benchmark measures is the protocol, not a hundred imports of torch on two
cores.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent.workers.zygote import PRELOAD, PRELOAD_LATER
from rendezvous.elastic.assigned import AssignedRendezvousHandler
from rendezvous.errors import EtcdUnavailableError
from rendezvous.etcd import EtcdConfig, create_client

POLL_S = 0.1  # agent/runner/elastic.py's monitor_interval
LEAVE_WAIT_S = 120.0
CONNECT_ATTEMPTS = 5


class Log:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (the member's lifetime)

    def emit(self, ev: str, **fields: Any) -> None:
        self._file.write(json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n")


def member(endpoint: str, root: str, job: str, node: str, first_min: int, outdir: Path) -> None:
    """One rendezvous member, as a runner uses it; never returns."""
    leaving = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: leaving.set())
    out = Log(outdir / f"{node}.jsonl")
    for attempt in range(CONNECT_ATTEMPTS):  # as an agent starts a failed runner again
        try:
            client = create_client(EtcdConfig(endpoints=[endpoint], root=root, timeout_s=30))
            break
        except EtcdUnavailableError as exc:
            out.emit("retry", error=str(exc))
            if attempt == CONNECT_ATTEMPTS - 1:
                raise
    handler = AssignedRendezvousHandler(
        client, run_id=job, node_id=node, addr="127.0.0.1", min_nodes=first_min,
        max_nodes=100_000,
        root=root, lease_ttl_s=5, join_timeout_s=600.0,
    )
    out.emit("joining")
    info = handler.next_rendezvous()
    out.emit("round", round=handler.current_round(), world=info.world_size)
    handler.set_bounds(1, 100_000)
    while not leaving.is_set():
        change = handler.pending_change()
        if change is not None:
            out.emit("noticed", kind=change.kind, nodes=sorted(change.nodes))
            info = handler.next_rendezvous()
            out.emit("round", round=handler.current_round(), world=info.world_size)
            continue
        leaving.wait(POLL_S)
    handler.announce_leaving()
    out.emit("announced")
    deadline = time.monotonic() + LEAVE_WAIT_S
    while time.monotonic() < deadline:
        change = handler.pending_change()
        if change is not None and change.kind == "superseded":
            break
        time.sleep(POLL_S)
    handler.leave()
    out.emit("left")
    client.close()
    os._exit(0)


def members(endpoint: str, root: str, job: str, outdir: Path) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reaped by the kernel
    while line := sys.stdin.readline():
        words = line.split()
        if len(words) < 2 or words[0] != "spawn":
            continue
        for node in words[2:]:
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    member(endpoint, root, job, node, int(words[1]), outdir)
                except BaseException:
                    Log(outdir / f"{node}.jsonl").emit("failed", error=traceback.format_exc())
                finally:
                    os._exit(1)
            print(f"pid {node} {pid}", flush=True)


def _form(rank: int, world: int, port: int) -> dict[str, float]:
    """A gloo group, DDP on a tiny model, rank 0's state to everyone, one step."""
    times: dict[str, float] = {}
    start = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    times["init_process_group"] = time.monotonic() - start
    mark = time.monotonic()
    torch.manual_seed(rank)
    model = torch.nn.Linear(16, 4)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    times["state_sync+ddp"] = time.monotonic() - mark
    mark = time.monotonic()
    ddp(torch.randn(8, 16)).sum().backward()
    times["first_step"] = time.monotonic() - mark
    times["total"] = time.monotonic() - start
    return times


def worker(rank: int, world: int, port: int, outdir: Path) -> None:
    torch.set_num_threads(1)
    first = _form(rank, world, port)
    dist.destroy_process_group()
    again = _form(rank, world, port + 1)
    dist.destroy_process_group()
    (outdir / f"{rank}.json").write_text(json.dumps({"first": first, "reform": again}))


def workers(world: int, port: int, outdir: Path) -> None:
    # What a tidal zygote imports before it forks a worker (agent.workers.zygote), so
    # that the first formation is not a first DDP's imports (sympy, dynamo).
    for module in (*PRELOAD, *PRELOAD_LATER):
        importlib.import_module(module)
    (outdir / "parent.json").write_text(json.dumps({"cpu": time.process_time()}))
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                worker(rank, world, port, outdir)
                os._exit(0)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def main(argv: list[str]) -> None:
    if argv[0] == "members":
        endpoint, root, job, outdir = argv[1:]
        members(endpoint, root, job, Path(outdir))
    elif argv[0] == "workers":
        world, port, outdir = argv[1:]
        workers(int(world), int(port), Path(outdir))
    else:
        raise SystemExit(f"unknown part {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
