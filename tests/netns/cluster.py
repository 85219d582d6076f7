"""A whole tidal deployment across network namespaces: 3 etcd hosts, a coordinator, agents.

Layout on the private /24 of a :class:`~tests.support.netns.Network`:

======== ========= ==================================================
host     address   runs
======== ========= ==================================================
``ctl``  .2        nothing: the test's own HTTP client thread (the operator)
``e1-3`` .11-.13   one member each of a 3-member etcd cluster (2379/2380)
``coord`` .20      ``tidal coordinator`` (API on 8470)
``a1-4`` .31-.34   ``tidal agent --node-id aN --address <its IP>``
======== ========= ==================================================

Every process is started with ``ip netns exec`` on its host, in a process
group of its own; training traffic (gloo, the workers' TCPStore) goes between
the agents' addresses, and every tidal process reaches etcd on the three
members' addresses, as on separate machines.

This machine's host name resolves to 127.0.0.1 in every namespace (as
Debian's 127.0.1.1 does on real machines), and gloo binds to what the host
name resolves to unless told an interface: the jobs set nothing, so these
tests also check that the agent names its ``--address``'s interface in
``GLOO_SOCKET_IFNAME`` for the workers (agent/runner/netif.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.agents import is_idle_warm_runner, parent_of, read_events
from tests.support.netns import Host, NamespaceThread, Network
from tests.support.wait import wait_for

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
ELASTIC_DDP = REPO / "examples" / "elastic_ddp.py"
MLP = REPO / "examples" / "mlp.py"
TOKEN = "netns-test-token-0123456789abcdef"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
API_PORT = 8470
LEASE_TTL_S = 3
ELECTION_TTL_S = 3
#: The modules a job runner is started as (``python -m MODULE``): now, and before the zygote.
RUNNER_MODULES = frozenset({b"agent.runner", b"agent.runner.elastic"})
#: What every job's workers need to run gloo across the namespaces (see the module doc).
WORKER_ENV: dict[str, str] = {}  # the agent sets GLOO_SOCKET_IFNAME itself


@dataclass
class EtcdMember:
    name: str
    host: Host
    data_dir: Path
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"{self.host.ip}:{ETCD_CLIENT_PORT}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host.ip}:{ETCD_PEER_PORT}"


class Api:
    """The coordinator's HTTP API, called from the ``ctl`` host's namespace thread."""

    def __init__(self, thread: NamespaceThread, base_url: str, token: str = TOKEN) -> None:
        self.thread = thread
        self.base_url = base_url
        self.token = token

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self.thread.local, "api", None)
        if client is None:
            client = httpx.Client(
                base_url=self.base_url, timeout=10.0,
                headers={"Authorization": f"Bearer {self.token}"},
            )
            self.thread.local.api = client
        return client

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        def call() -> httpx.Response:
            return self._client().request(method, path, **kwargs)

        return self.thread.call(call, timeout=30.0)

    def get(self, path: str) -> httpx.Response:
        return self.request("GET", path)

    def post(self, path: str, json_body: Any = None) -> httpx.Response:
        return self.request("POST", path, json=json_body)

    def job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``.

        Raises:
            AssertionError: the API did not answer 200.
        """
        response = self.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, (response.status_code, response.text)
        return dict(response.json())

    def events(self, job_id: str) -> list[dict[str, Any]]:
        response = self.get(f"/v1/jobs/{job_id}/events")
        assert response.status_code == 200, (response.status_code, response.text)
        return list(response.json()["events"])

    def submit(self, spec: dict[str, Any]) -> str:
        response = self.post("/v1/jobs", spec)
        assert response.status_code == 201, (response.status_code, response.text)
        return str(response.json()["job_id"])

    def running_at(self, job_id: str, size: int) -> bool:
        """True when the job is RUNNING at ``size`` with disjoint ranks covering 0..size-1."""
        view = self.job(job_id)
        if view["phase"] != "RUNNING" or view["world_size"] != size:
            return False
        ranks = [r for node in view["nodes"] for r in node["ranks"]]
        return sorted(ranks) == list(range(size))


class NetnsCluster:
    """tidal on separate "machines". Build it, :meth:`start` it; the network fixture ends it.

    Args:
        net: the network to build the hosts on.
        workdir: logs, etcd data, run directories, token file.
        etcd_binary: the etcd executable (a durable version: tests kill it).
        agents: how many agent hosts to create (``a1``..``aN``); started by
            :meth:`start` unless ``start_agents`` is False.
    """

    def __init__(self, net: Network, workdir: Path, *, etcd_binary: Path, agents: int = 3) -> None:
        self.net = net
        self.workdir = workdir
        self.etcd_binary = etcd_binary
        self.ctl = net.add_host("ctl", index=2)
        self.etcd: dict[str, EtcdMember] = {}
        for i in range(1, 4):
            name = f"e{i}"
            host = net.add_host(name, index=10 + i)
            self.etcd[name] = EtcdMember(
                name, host, workdir / f"etcd-{name}", workdir / f"{name}.log"
            )
        self.coord_host = net.add_host("coord", index=20)
        self.agent_hosts = {
            f"a{i}": net.add_host(f"a{i}", index=30 + i) for i in range(1, agents + 1)
        }
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.token_file = workdir / "token"
        self.token_file.write_text(TOKEN)
        self.api = Api(net.thread(self.ctl), f"http://{self.coord_host.ip}:{API_PORT}")

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.etcd.values())

    def start(self, *, start_agents: bool = True) -> NetnsCluster:
        for name in self.etcd:
            self.start_etcd(name, wait=False)
        for name in self.etcd:
            self.wait_etcd_healthy(name)
        self.start_coordinator()
        if start_agents:
            for node in self.agent_hosts:
                self.start_agent(node)
            self.wait_nodes(set(self.agent_hosts))
        return self

    # etcd ------------------------------------------------------------------------

    def start_etcd(self, name: str, *, wait: bool = True) -> None:
        """Start member ``name`` (again: same data directory, as an operator restarting it)."""
        member = self.etcd[name]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.etcd.values())
        client_url = f"http://{member.host.ip}:{ETCD_CLIENT_PORT}"
        argv = [
            str(self.etcd_binary), "--name", name, "--data-dir", str(member.data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", self.net.prefix.rstrip("-"),
            # etcd 3.5 pre-votes by default; 3.4 (Debian's, durable) does not:
            # there a member cut off for a while campaigns in a loop, and when
            # it is back its higher term deposes a healthy leader (an election
            # that fails in-flight calls with "leader changed").
            "--pre-vote",
            "--logger", "zap", "--log-level", "warn",
        ]
        self.net.spawn(member.host, argv, log_path=member.log_path)
        if wait:
            self.wait_etcd_healthy(name)

    def _etcd_http(self, member: EtcdMember, path: str, body: bytes | None = None) -> Any:
        url = f"http://{member.endpoint}{path}"

        def call() -> Any:
            request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
            with urllib.request.urlopen(request, timeout=2.0) as response:
                return json.loads(response.read())

        return self.api.thread.call(call, timeout=10.0)

    def etcd_healthy(self, name: str) -> bool:
        try:
            return bool(self._etcd_http(self.etcd[name], "/health").get("health") == "true")
        except Exception:
            return False

    def wait_etcd_healthy(self, name: str, timeout: float = 30.0) -> None:
        wait_for(lambda: self.etcd_healthy(name), timeout=timeout, interval=0.2,
                 what=f"etcd member {name} healthy")

    def etcd_leader(self) -> str | None:
        """The name of the member that leads the etcd cluster now, as a live member says."""
        ids: dict[str, str] = {}
        leader = None
        for name, member in self.etcd.items():
            try:
                status = self._etcd_http(member, "/v3/maintenance/status", b"{}")
            except Exception:
                continue
            ids[str(status["header"]["member_id"])] = name
            leader = str(status.get("leader", ""))
        return ids.get(leader) if leader else None

    def move_etcd_leader(self, *, away_from: str) -> str:
        """Hand the etcd leadership to another member if ``away_from`` leads; return the leader."""
        leader = self.wait_etcd_leader()
        if leader != away_from:
            return leader
        target = next(name for name in self.etcd if name != away_from)
        status = self._etcd_http(self.etcd[target], "/v3/maintenance/status", b"{}")
        body = json.dumps({"targetID": status["header"]["member_id"]}).encode()
        self._etcd_http(self.etcd[leader], "/v3/maintenance/transfer-leadership", body)
        return self.wait_etcd_leader(other_than=away_from)

    def wait_etcd_leader(self, *, other_than: str | None = None, timeout: float = 30.0) -> str:
        """Wait until a member (not ``other_than``) leads; return its name."""

        def leader() -> str | None:
            name = self.etcd_leader()
            return name if name is not None and name != other_than else None

        what = "an etcd leader" + (f" other than {other_than}" if other_than else "")
        found = wait_for(leader, timeout=timeout, interval=0.2, what=what)
        assert found is not None
        return found

    def etcd_members_used_by(self, pid: int) -> set[str]:
        """The etcd members process ``pid`` has an established connection to (from /proc)."""
        sockets = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    sockets.add(target[len("socket:["):-1])
        by_address = {m.host.ip: name for name, m in self.etcd.items()}
        used = set()
        # gRPC may use IPv6 sockets, with IPv4-mapped addresses (::ffff:a.b.c.d).
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                address, port = remote.split(":")
                if state != "01" or inode not in sockets or int(port, 16) != ETCD_CLIENT_PORT:
                    continue
                # The last 32 bits, in host (little-endian) order in each word.
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(address[-8:])))
                if ip in by_address:
                    used.add(by_address[ip])
        return used

    def runner_pids(self, node: str) -> list[int]:
        """PIDs of the job runners (``python -m agent.runner``) on ``node``'s host.

        A warm runner that waits for a job is left out; one that took a job
        titles itself as a runner started for it (one string).
        """
        found = []
        for pid, argv in self._commands(node).items():
            words = {w for arg in argv for w in arg.split()}
            if RUNNER_MODULES & words and not is_idle_warm_runner(argv):
                found.append(pid)
        return found

    def job_pids(self, node: str) -> list[int]:
        """PIDs on ``node``'s host that work for a job: all but the agent, and
        its warm runner waiting for a job, and that runner's zygote."""
        commands = self._commands(node)
        idle = {pid for pid, argv in commands.items() if is_idle_warm_runner(argv)}
        return [pid for pid in commands
                if pid != self.agents[node].pid and pid not in idle and parent_of(pid) not in idle]

    def _commands(self, node: str) -> dict[int, list[bytes]]:
        """Each live command line on ``node``'s host (split on NUL), by PID."""
        found = {}
        for pid in self.net.pids(self.agent_hosts[node]):
            with contextlib.suppress(OSError):
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return found

    def kill_etcd(self, name: str) -> None:
        """SIGKILL member ``name``'s host (the machine dies; its data directory survives)."""
        self.net.kill_host(self.etcd[name].host)

    # coordinator and agents ----------------------------------------------------------

    def start_coordinator(self, timeout: float = 60.0) -> None:
        argv = [
            sys.executable, "-m", "service.cli", "coordinator",
            "--etcd", self.endpoints, "--host", self.coord_host.ip, "--port", str(API_PORT),
            "--token-file", str(self.token_file),
            "--workdir-root", str(self._dir("work")),
            "--checkpoint-root", str(self._dir("checkpoints")),
            "--election-ttl", str(ELECTION_TTL_S),
        ]
        self.coordinator = self.net.spawn(
            self.coord_host, argv, log_path=self.workdir / "coordinator.log", cwd=REPO
        )

        def ready() -> bool:
            assert self.coordinator is not None
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited:\n{self.tail('coordinator.log')}")
            return self.api.get("/readyz").status_code == 200

        wait_for(ready, timeout=timeout, interval=0.3, what="the coordinator's /readyz")

    def start_agent(self, node: str) -> None:
        host = self.agent_hosts[node]
        argv = [
            sys.executable, "-m", "service.cli", "agent",
            "--etcd", self.endpoints, "--node-id", node, "--address", host.ip,
            "--run-dir", str(self._dir("agents") / node), "--lease-ttl", str(LEASE_TTL_S),
        ]
        self.agents[node] = self.net.spawn(
            host, argv, log_path=self.workdir / f"agent-{node}.log", cwd=REPO
        )

    def nodes(self) -> set[str]:
        response = self.api.get("/v1/nodes")
        assert response.status_code == 200, (response.status_code, response.text)
        return {n["node_id"] for n in response.json()}

    def wait_nodes(self, nodes: set[str], timeout: float = 60.0) -> None:
        wait_for(lambda: self.nodes() == nodes, timeout=timeout, interval=0.3,
                 what=f"nodes {sorted(nodes)} registered")

    # jobs --------------------------------------------------------------------------

    def elastic_ddp_spec(self, name: str, *, min_nodes: int = 1, max_nodes: int = 3,
                         step_seconds: float = 0.1, **extra: Any) -> dict[str, Any]:
        """examples/elastic_ddp.py (float64 DDP over gloo), one JSON line per step and rank."""
        spec: dict[str, Any] = {
            "name": name,
            "command": [sys.executable, str(ELASTIC_DDP),
                        "--checkpoint", str(self.workdir / f"{name}-ckpt-{{node}}.pt"),
                        "--events", str(self.events_path(name)),
                        "--step-seconds", str(step_seconds)],
            "env": dict(WORKER_ENV),
            "min_nodes": min_nodes, "max_nodes": max_nodes, "grace_period_s": 5,
        }
        spec.update(extra)
        return spec

    def events_path(self, name: str) -> Path:
        return self.workdir / f"{name}-events.jsonl"

    def node_of_rank(self, job_id: str, rank: int) -> str:
        for node in self.api.job(job_id)["nodes"]:
            if rank in node["ranks"]:
                return str(node["node_id"])
        raise AssertionError(f"no node of job {job_id} holds rank {rank}")

    # diagnostics --------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(exist_ok=True)
        return path

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.workdir / name
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def log_tails(self, lines: int = 40) -> str:
        """The end of every log this cluster wrote: etcd, coordinator, agents, runners, ranks."""
        paths = sorted(self.workdir.glob("*.log"))
        paths += sorted((self.workdir / "agents").rglob("*.log"))
        out = []
        for path in paths:
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.relative_to(self.workdir)} ---\n" + "\n".join(text))
        return "\n".join(out)


# The workers' step events (examples/elastic_ddp.py --events) --------------------------


def step_events(path: Path, *, after: float = 0.0) -> list[dict[str, Any]]:
    """Every step record (node, rank, world_size, step, restarts, time) stamped after ``after``."""
    return [r for r in read_events(path) if r.get("time", 0.0) > after]


def first_step_at(path: Path, world_size: int, *, after: float) -> dict[str, Any] | None:
    """The first step completed at ``world_size`` after ``after`` (wall clock), if any."""
    found = [r for r in step_events(path, after=after) if r["world_size"] == world_size]
    return min(found, key=lambda r: r["time"]) if found else None


def wait_first_step_at(
    path: Path, world_size: int, *, after: float, timeout: float, what: str
) -> dict[str, Any]:
    """Wait for :func:`first_step_at` to find a step; return it."""
    found = wait_for(lambda: first_step_at(path, world_size, after=after), timeout=timeout,
                     interval=0.1, what=what)
    assert found is not None
    return found


def last_step(path: Path) -> int:
    return max((int(r["step"]) for r in read_events(path)), default=0)


def wait_steps(path: Path, count: int, *, timeout: float, what: str = "") -> int:
    """Wait until ``count`` more steps than now were completed; returns the newest step."""
    start = last_step(path)
    return wait_for(lambda: last_step(path) >= start + count and last_step(path),
                    timeout=timeout, interval=0.2,
                    what=what or f"{count} more steps after step {start}")


def duplicate_ranks(records: list[dict[str, Any]]) -> dict[tuple[int, int], list[str]]:
    """(step, rank) pairs completed by more than one node: two groups training at once."""
    by_slot: dict[tuple[int, int], set[str]] = {}
    for r in records:
        by_slot.setdefault((int(r["step"]), int(r["rank"])), set()).add(str(r["node"]))
    return {slot: sorted(nodes) for slot, nodes in by_slot.items() if len(nodes) > 1}
