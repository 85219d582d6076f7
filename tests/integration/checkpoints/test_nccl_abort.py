"""A NCCL worker blocked in a collective on a dead peer exits soon after SIGTERM
(checkpoints.nccl), not after the process group's timeout. Needs 2 CUDA GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.wait import wait_for

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

WORKER = """
import datetime, os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from checkpoints import nccl
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
nccl.prepare_environment()
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                        device_id=torch.device("cuda", rank))
signal.signal(signal.SIGTERM, lambda *_: None)  # as the checkpoints library does
watcher = nccl.abort_on_stop(delay_s=0.5)
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t); torch.cuda.synchronize()
if rank == 1:
    os._exit(1)  # the peer dies
Path(sys.argv[1]).write_text("blocked")
try:
    dist.all_reduce(t); torch.cuda.synchronize()
except Exception as exc:
    print("collective failed:", type(exc).__name__, flush=True)
    os._exit(75)
os._exit(0)
"""


@pytest.mark.timeout(240)
def test_a_worker_blocked_on_a_dead_peer_stops_within_seconds(tmp_path: Path) -> None:
    marker = tmp_path / "blocked"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", WORLD_SIZE="2")
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(marker)],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         start_new_session=True)
        for r in range(2)
    ]
    try:
        wait_for(marker.exists, timeout=120, what="rank 0 to block on its dead peer")
        assert procs[1].wait(timeout=30) == 1
        started = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)  # what the runner sends
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - started
        assert code == 75, f"rank 0 ended with {code}"
        assert took < 30, f"rank 0 took {took:.1f} s to stop (the timeout is 300 s)"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
