"""A whole tidal deployment for the chaos soak, built from the test support pieces.

Three etcd members (:class:`~tests.integration.rendezvous.etcd_cluster.LoopbackEtcdCluster`),
two coordinators (:class:`~tests.support.coordinator.CoordinatorProcess`, one
leads) and three agents (:class:`~tests.support.agents.AgentCluster`), every
process in its own process group through the test's
:class:`~tests.support.processes.ProcessGroupRegistry`. The soak kills and
stops them; this module finds the processes (an agent's runner and workers
are its descendants) and restarts what an operator's supervisor would.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx

from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.records import JobNodeStatus
from tests.integration.rendezvous.etcd_cluster import LoopbackEtcdCluster
from tests.support.agents import AgentCluster, is_idle_warm_runner, statuses
from tests.support.coordinator import CoordinatorProcess
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"
ROOT = "/tidal-chaos"
LEASE_TTL_S = 3
ELECTION_TTL_S = 2  # CoordinatorProcess's --election-ttl
NODES = ("a1", "a2", "a3")
COORDINATORS = ("c1", "c2")


def process_table() -> dict[int, tuple[int, list[bytes], str]]:
    """Every live process: pid -> (parent pid, argv, state letter); zombies left out."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if stat[0] != "Z":
            table[int(entry.name)] = (int(stat[1]), argv, stat[0])
    return table


def descendants(root: int, table: dict[int, tuple[int, list[bytes], str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def processes_with_env(marker: str) -> list[int]:
    """Live processes (other than this one) whose environment holds ``marker`` (NAME=VALUE)."""
    needle = marker.encode()
    found = []
    for pid in process_table():
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
    return found


class ChaosCluster:
    """etcd x3, coordinators x2 and agents x3 on loopback; :meth:`start` it, ``procs`` ends it.

    Args:
        procs: the test's process registry.
        workdir: logs, data directories, run directories.
        etcd_binary: a durable etcd (the soak kills members).
    """

    def __init__(self, *, procs: ProcessGroupRegistry, workdir: Path, etcd_binary: Path) -> None:
        self.procs = procs
        self.workdir = workdir
        (workdir / "etcd").mkdir(parents=True, exist_ok=True)
        (workdir / "agents").mkdir(exist_ok=True)
        self.etcd = LoopbackEtcdCluster(procs, workdir / "etcd", etcd_binary)
        self.coordinators: dict[str, CoordinatorProcess] = {}
        self.agents: AgentCluster | None = None
        self.stopped: set[str] = set()  # coordinators now SIGSTOPped: the API avoids them
        self.client: EtcdClient | None = None  # the test's own, to read the agents' status

    def start(self) -> ChaosCluster:
        self.etcd.start()
        endpoints = ",".join(self.etcd.endpoints)
        self.client = create_client(
            EtcdConfig(endpoints=self.etcd.endpoints, timeout_s=5.0, root=ROOT))
        for name in COORDINATORS:
            self.coordinators[name] = CoordinatorProcess(
                etcd_endpoint=endpoints, etcd_root=ROOT, workdir=self.workdir,
                procs=self.procs, name=name,
            ).start(timeout=60)
        self.agents = AgentCluster(etcd_endpoint=endpoints, etcd_root=ROOT,
                                   workdir=self.workdir / "agents", procs=self.procs)
        for node in NODES:
            self.start_agent(node)
        return self

    # the API, through whichever coordinator answers -----------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the API on a live coordinator (each in turn); return the JSON body.

        Raises:
            RuntimeError: no coordinator answered 2xx; names each one's answer.
        """
        errors = []
        for name, coordinator in self.coordinators.items():
            if name in self.stopped or not coordinator.url:
                continue
            try:
                with coordinator.client() as client:
                    response = client.request(method, path, timeout=5.0, **kwargs)
            except httpx.HTTPError as exc:
                errors.append(f"{name}: {exc!r}")
                continue
            if response.is_success:
                return response.json()
            errors.append(f"{name}: {response.status_code} {response.text[:200]}")
        raise RuntimeError(f"no coordinator answered {method} {path}: {'; '.join(errors)}")

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.api("GET", f"/v1/jobs/{job_id}"))

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.api("GET", f"/v1/jobs/{job_id}/events")["events"])

    def node_status(self, job_id: str, node: str) -> JobNodeStatus | None:
        """What ``node``'s agent reports for the job, read from etcd."""
        assert self.client is not None
        return statuses(self.client, job_id).get(node)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # agents -----------------------------------------------------------------------------

    def start_agent(self, node: str) -> None:
        assert self.agents is not None
        self.agents.start_agent(node, lease_ttl_s=LEASE_TTL_S)

    def agent_pid(self, node: str) -> int:
        assert self.agents is not None
        return self.agents.agents[node].pid

    def kill_agent(self, node: str) -> list[int]:
        """SIGKILL the agent's process group; return the pids that were below it."""
        assert self.agents is not None
        below = descendants(self.agent_pid(node), process_table())
        self.agents.kill_agent(node)
        return below

    def signal_agent_group(self, node: str, sig: int) -> None:
        assert self.agents is not None
        self.procs.signal_group(self.agents.agents[node], sig)

    def runner_of(self, node: str) -> int | None:
        """The pid of the node's job runner (not an idle warm one), if there is one."""
        table = process_table()
        for pid in descendants(self.agent_pid(node), table):
            argv = table[pid][1]
            # A runner that took a job retitled itself: its command line is one string.
            if b"agent.runner" in b" ".join(argv) and not is_idle_warm_runner(argv):
                return pid
        return None

    def workers_of(self, node: str) -> list[int]:
        """The pids of the node's training workers (not their shims, runner or zygote)."""
        table = process_table()
        script = str(MLP).encode()
        return [
            pid for pid in descendants(self.agent_pid(node), table)
            if any(script in arg for arg in table[pid][1])
            and not any(b"worker_shim" in arg or b"agent." in arg for arg in table[pid][1])
        ]

    # coordinators -----------------------------------------------------------------------

    def leader(self) -> str | None:
        for name, coordinator in self.coordinators.items():
            if name in self.stopped:
                continue
            with contextlib.suppress(httpx.HTTPError, AssertionError):
                if coordinator.is_leader():
                    return name
        return None

    def kill_coordinator(self, name: str) -> None:
        self.coordinators[name].kill()

    def restart_coordinator(self, name: str) -> None:
        self.coordinators[name].start(timeout=60)

    def signal_coordinator(self, name: str, sig: int) -> None:
        process = self.coordinators[name].process
        assert process is not None
        self.procs.signal_group(process, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(name)
        elif sig == signal.SIGCONT:
            self.stopped.discard(name)

    def wait_coordinators(self, timeout: float = 60.0) -> str:
        """Wait until both coordinators answer /healthz and one leads; return the leader."""
        for name, coordinator in self.coordinators.items():
            url = f"{coordinator.url}/healthz"
            wait_for(lambda u=url: httpx.get(u, timeout=2).is_success,  # type: ignore[misc]
                     timeout=timeout, interval=0.2, what=f"coordinator {name} healthy")
        leader: str = wait_for(self.leader, timeout=timeout, interval=0.2,
                               what="a coordinator leading")
        return leader

    # etcd -------------------------------------------------------------------------------

    def kill_etcd(self, name: str) -> None:
        process = self.etcd.members[name].process
        assert process is not None
        self.procs.kill_group(process)

    def log_tails(self, lines: int = 30) -> str:
        parts = [self.etcd.log_tails(lines)]
        for name, coordinator in self.coordinators.items():
            parts.append(f"--- coordinator {name} ---\n{coordinator.log_tail(lines)}")
        if self.agents is not None:
            parts.append(self.agents.log_tails(lines))
        return "\n".join(parts)
