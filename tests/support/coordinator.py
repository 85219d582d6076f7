"""Run real `tidal coordinator` processes (uvicorn on a free loopback port) in tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from rendezvous.etcd.server import EtcdServer
from service.up.ready import read_ready
from tests.support.agents import AgentCluster
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

TOKEN = "test-token-0123456789abcdef"


def wait_for_url(
    process: subprocess.Popen[bytes], ready_file: Path, *, log_path: Path, timeout: float = 30.0
) -> str:
    """The URL a coordinator started with ``--ready-file ready_file`` says it serves on,
    once it does (its log is for people, not read here).

    Raises:
        RuntimeError: the coordinator exited first (its log's tail is in the message).
    """

    def url() -> str | None:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
            raise RuntimeError(f"the coordinator exited:\n{tail}")
        ready = read_ready(ready_file, process.pid)
        return ready.url if ready is not None else None

    return wait_for(url, timeout=timeout, what=f"the coordinator's ready file {ready_file}")


class CoordinatorProcess:
    """One coordinator replica as a separate process, in its own process group.

    Args:
        etcd_endpoint / etcd_root: the etcd it uses.
        workdir: where its log, token file and roots go.
        procs: the test's process registry (kills it at teardown).
        name: tells replicas apart in file names.
        extra: more command-line flags.
        env: the process's environment (default: this one's), e.g. to pass
            TIDAL_ETCD_PASSWORD, which has no flag.
    """

    def __init__(
        self,
        *,
        etcd_endpoint: str,
        etcd_root: str,
        workdir: Path,
        procs: ProcessGroupRegistry,
        name: str = "coordinator",
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.env = env
        self.procs = procs
        self.log_path = workdir / f"{name}.log"
        self.ready_file = workdir / f"{name}.ready.json"
        self.token_file = workdir / "token"
        self.token_file.write_text(TOKEN)
        self.workdir_root = workdir / "work"
        self.checkpoint_root = workdir / "checkpoints"
        self.workdir_root.mkdir(exist_ok=True)
        self.argv = [
            sys.executable, "-m", "service.cli", "coordinator",
            "--etcd", etcd_endpoint, "--etcd-root", etcd_root, "--port", "0",
            "--token-file", str(self.token_file),
            "--workdir-root", str(self.workdir_root),
            "--checkpoint-root", str(self.checkpoint_root),
            "--election-ttl", "2", "--ready-file", str(self.ready_file),
            *extra,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 30.0) -> CoordinatorProcess:
        self.process = self.procs.spawn(self.argv, log_path=self.log_path, env=self.env)
        self.url = wait_for_url(self.process, self.ready_file, log_path=self.log_path,
                                timeout=timeout)
        wait_for(lambda: httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200,
                 timeout=timeout, what="the coordinator's /healthz")
        return self

    def kill(self) -> None:
        """SIGKILL the replica's process group, as a crash would."""
        assert self.process is not None
        self.procs.kill_group(self.process)

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10.0)

    def is_leader(self) -> bool:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return "tidal_coordinator_leader 1.0" in text

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def job_spec(name: str = "job", **overrides: Any) -> dict[str, Any]:
    """A valid job spec that a test can adjust."""
    spec: dict[str, Any] = {
        "name": name, "command": [sys.executable, "-c", "print('hi')"],
        "min_nodes": 1, "max_nodes": 1,
    }
    spec.update(overrides)
    return spec


def job_view(api: httpx.Client, job_id: str) -> dict[str, Any]:
    """``GET /v1/jobs/{job_id}``'s body, asserting it answered 200."""
    response = api.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@contextlib.contextmanager
def coordinator_and_agents(
    *, tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry,
    coordinator_flags: tuple[str, ...] = (),
) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    """A started coordinator (with ``coordinator_flags`` added) and an (empty) agent
    cluster on one etcd; both logs' tails are printed when the body fails. The
    registry stops them."""
    coordinator = CoordinatorProcess(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs,
        extra=coordinator_flags,
    ).start()
    agents = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    try:
        yield coordinator, agents
    except BaseException:
        print(coordinator.log_tail(), agents.log_tails(), sep="\n")
        raise
