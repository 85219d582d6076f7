"""A gloo collective blocked on a peer that hangs (SIGSTOP: no FIN) returns within 0.5 s of the
runner's lost notice (checkpoints.live.unblock), and the process goes on.

Three real processes in a gloo group (timeout 30 s); rank 2 is stopped while ranks 0
and 1 wait in an all-reduce for it; then the runner's notice (``live-lost.json``) is
written into each survivor's progress directory. Their all-reduce must raise within
0.5 s of it, and both must still run and be able to form a new group of two.

The survivors report through files: a process stopped while it held the
multiprocessing queue's lock would hold up a queue.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from checkpoints.protocol.live import write_lost_notice
from rendezvous.etcd.server import free_port
from tests.support.wait import wait_for


def _worker(rank: int, port: int, port2: int, directory: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from checkpoints.live.unblock import Unblocker

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3, timeout=datetime.timedelta(seconds=30))
    tensor = torch.ones(1024)
    dist.all_reduce(tensor)  # every pair connected
    unblock = Unblocker(Path(directory)).start()
    unblock.record()
    out.put(("ready", rank, os.getpid()))
    if rank == 2:
        time.sleep(3600)
    try:
        while True:
            dist.all_reduce(tensor)
    except RuntimeError as exc:
        # A file, not the queue: the stopped peer may hold the queue's lock.
        (Path(directory) / "raised").write_text(json.dumps([time.time(), str(exc)[:200]]))
    unblock.handled()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    (Path(directory) / "re-formed").write_text(json.dumps(float(tensor[0])))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_collective_blocked_on_a_stopped_peer_returns_within_half_a_second_of_the_notice(
    tmp_path: Path,
) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, port2 = free_port(), free_port()
    dirs = [tmp_path / f"rank{r}" for r in range(3)]
    for d in dirs:
        d.mkdir()
    procs = [ctx.Process(target=_worker, args=(r, port, port2, str(dirs[r]), out))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        pids = {}
        for _ in range(3):
            kind, rank, pid = out.get(timeout=90)
            assert kind == "ready"
            pids[rank] = pid
        os.kill(pids[2], signal.SIGSTOP)
        time.sleep(0.5)  # the survivors are inside the all-reduce: nothing returns it
        assert out.empty()
        noticed = time.time()
        for d in dirs[:2]:
            write_lost_notice(d, round_=1, now=noticed)
        wait_for(lambda: all((d / "raised").exists() for d in dirs[:2]), timeout=30,
                 what="both survivors' all-reduce raising")
        raised = [json.loads((d / "raised").read_text())[0] - noticed for d in dirs[:2]]
        assert max(raised) < 0.5, raised
        wait_for(lambda: all((d / "re-formed").exists() for d in dirs[:2]), timeout=60,
                 what="both survivors re-forming a group of two")
        assert [json.loads((d / "re-formed").read_text()) for d in dirs[:2]] == [2.0, 2.0]
    finally:
        for p in procs:
            if p.pid is not None:
                with_suppress_kill(p.pid)
            p.join(timeout=10)


def with_suppress_kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
