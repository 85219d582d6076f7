"""A real 3-member etcd cluster on loopback ports, for the client's failover tests.

:class:`~rendezvous.etcd.server.EtcdServer` runs one member; failover needs
several members of *one* cluster, so that a call that fails over reads and
writes the same data. Every member runs in its own process group through the
test's :class:`~tests.support.processes.ProcessGroupRegistry` (killed at
teardown), with its own data directory and log.

:meth:`LoopbackEtcdCluster.pause` stands in for a member cut off from the
network: a SIGSTOPped etcd keeps its sockets, the kernel still accepts
connections and buffers requests, and nothing answers, so a call waits for its
deadline instead of being refused (tests/netns cuts a real link instead).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rendezvous.etcd.server import free_port
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

HOST = "127.0.0.1"


@dataclass
class Member:
    name: str
    data_dir: Path
    log_path: Path
    client_port: int = 0
    peer_port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"


class LoopbackEtcdCluster:
    """``size`` etcd members on 127.0.0.1. :meth:`start` it; the ``procs`` fixture ends it.

    Args:
        procs: the test's process registry.
        workdir: data directories and logs.
        binary: the etcd executable.
        size: how many members.
    """

    def __init__(
        self, procs: ProcessGroupRegistry, workdir: Path, binary: Path, *, size: int = 3
    ) -> None:
        self.procs = procs
        self.binary = binary
        self.members = {
            f"m{i}": Member(f"m{i}", workdir / f"m{i}-data", workdir / f"m{i}.log")
            for i in range(1, size + 1)
        }
        self._paused: set[str] = set()

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members.values()]

    def name_of(self, endpoint: str) -> str:
        return next(name for name, m in self.members.items() if m.endpoint == endpoint)

    # lifecycle -------------------------------------------------------------------

    def start(self, *, timeout: float = 30.0, attempts: int = 3) -> LoopbackEtcdCluster:
        """Start every member and wait until each serves requests.

        Free ports are probed, then bound by etcd: another process may take one
        in between, so a start that loses that race is retried on new ports.

        Raises:
            RuntimeError: a member exited, or the cluster was not healthy in
                time; the message carries the members' log tails.
        """
        for attempt in range(1, attempts + 1):
            for member in self.members.values():
                member.client_port, member.peer_port = free_port(HOST), free_port(HOST)
            token = f"tidal-failover-{os.getpid()}-{next(iter(self.members.values())).peer_port}"
            for member in self.members.values():
                self._spawn(member, token)
            deadline = time.monotonic() + timeout
            while not all(self.healthy(name) for name in self.members):
                exited = [m for m in self.members.values()
                          if m.process is not None and m.process.poll() is not None]
                if exited or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            else:
                return self
            for member in self.members.values():
                if member.process is not None:
                    self.procs.kill_group(member.process)
            tails = self.log_tails()
            if "address already in use" not in tails or attempt == attempts:
                raise RuntimeError(f"the etcd cluster did not start (try {attempt}):\n{tails}")
            for member in self.members.values():  # a fresh start on new ports
                member.log_path.unlink(missing_ok=True)
                shutil.rmtree(member.data_dir, ignore_errors=True)
        return self  # unreachable; mypy

    def _spawn(self, member: Member, token: str) -> None:
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members.values())
        client_url = f"http://{member.endpoint}"
        argv = [
            str(self.binary), "--name", member.name, "--data-dir", str(member.data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            "--pre-vote", "--logger", "zap", "--log-level", "warn",
        ]
        member.process = self.procs.spawn(argv, log_path=member.log_path)

    def restart(self, name: str, *, timeout: float = 30.0) -> None:
        """Start member ``name`` again on its data directory (after it was killed), as an
        operator would, and wait until it serves. Its data directory holds the cluster's
        membership, so the initial-cluster flags are not read again."""
        self._spawn(self.members[name], "restarted")
        wait_for(lambda: self.healthy(name), timeout=timeout,
                 what=f"etcd member {name} serving again")

    # state -------------------------------------------------------------------------

    def _http(self, name: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"http://{self.members[name].endpoint}{path}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
        with urllib.request.urlopen(request, timeout=2.0) as response:  # loopback, our etcd
            return json.loads(response.read())

    def healthy(self, name: str) -> bool:
        try:
            return bool(self._http(name, "/health").get("health") == "true")
        except (OSError, ValueError):
            return False

    def leader(self) -> str | None:
        """The member that leads now, as an answering member says."""
        ids: dict[str, str] = {}
        leader = ""
        for name in self.members:
            if name in self._paused:
                continue
            try:
                status = self._http(name, "/v3/maintenance/status", {})
            except (OSError, ValueError):
                continue
            ids[str(status["header"]["member_id"])] = name
            leader = str(status.get("leader", ""))
        return ids.get(leader)

    def move_leader(self, *, away_from: str) -> str:
        """Hand the leadership to another member if ``away_from`` leads; return the leader."""
        leader = wait_for(self.leader, timeout=10, what="an etcd leader")
        if leader != away_from:
            return leader
        target = next(name for name in self.members if name != away_from)
        target_id = self._http(target, "/v3/maintenance/status", {})["header"]["member_id"]
        self._http(leader, "/v3/maintenance/transfer-leadership", {"targetID": target_id})

        def another_leader() -> str | None:
            now = self.leader()
            return now if now != away_from else None

        return wait_for(another_leader, timeout=10, what=f"a leader other than {away_from}")

    # faults ------------------------------------------------------------------------

    def pause(self, name: str, *, timeout: float = 5.0) -> None:
        """SIGSTOP member ``name`` and wait until every thread of it has stopped.

        ``kill`` returns before a busy multi-threaded process has stopped; a
        call sent in that gap would still be answered.
        """
        process = self.members[name].process
        assert process is not None
        os.killpg(process.pid, signal.SIGSTOP)
        self._paused.add(name)
        wait_for(lambda: _all_threads_stopped(process.pid), timeout=timeout, interval=0.01,
                 what=f"etcd member {name} stopped")

    def resume(self, name: str) -> None:
        process = self.members[name].process
        assert process is not None
        os.killpg(process.pid, signal.SIGCONT)
        self._paused.discard(name)

    def log_tails(self, lines: int = 20) -> str:
        out = []
        for member in self.members.values():
            text = member.log_path.read_text(errors="replace") if member.log_path.exists() else ""
            out.append(f"--- {member.name} ---\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)


def _all_threads_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is in the stopped state (``T``)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread exited
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


def wait_stopped(pid: int, *, timeout: float = 5.0) -> None:
    """Wait until every thread of process ``pid`` has stopped (after a SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout:g} s")
        time.sleep(0.01)
