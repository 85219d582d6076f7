"""Start the ranks of a framework test job with the torchrun-style environment tidal's runner
gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), each in its own process group, and wait for their exits with a deadline."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[4]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(*, rank: int, world_size: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    """One rank's environment: a node per rank (GROUP_RANK = RANK), no TIDAL_* leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "TORCHELASTIC"))}
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", GROUP_RANK=str(rank),
        LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT), TORCHELASTIC_RUN_ID="test",
    )
    env.update(extra)
    return env


def run_ranks(
    procs: ProcessGroupRegistry, script: Path, argv: Sequence[str], *, world_size: int,
    logs: Path, name: str, extra_env: dict[str, str] | None = None, timeout: float = 90,
) -> list[tuple[int, str]]:
    """Run ``script`` as ``world_size`` ranks; return each rank's (exit code, log text)."""
    port = free_port()
    started = []
    for rank in range(world_size):
        log_path = logs / f"{name}-rank{rank}.log"
        env = rank_env(rank=rank, world_size=world_size, port=port, extra=extra_env or {})
        proc = procs.spawn([sys.executable, str(script), *argv], log_path=log_path, env=env,
                           cwd=ROOT)
        started.append((proc, log_path))
    for proc, _ in started:
        wait_for(lambda p=proc: p.poll() is not None, timeout=timeout,  # type: ignore[misc]
                 what=f"the ranks of {name} to exit")
    return [(int(p.returncode), path.read_text(errors="replace")) for p, path in started]
