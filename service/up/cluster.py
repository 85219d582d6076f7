"""`tidal up`: a whole tidal cluster on this machine, from one command.

:class:`LocalCluster` starts an embedded etcd, one coordinator and N node
agents as child processes, each in a process group of its own with its output
in ``STATE/logs/<name>.log``; waits until the API answers ``/readyz`` and every
node has registered; and writes ``STATE/cluster.json`` (address, token file,
pids) for the CLI and for scripts. :meth:`LocalCluster.stop` stops what it
started in order: the agents (SIGTERM, so their workers checkpoint; SIGKILL
after a grace), the coordinator, then etcd. ``tidal up`` (service/up/command.py) is
around it; ``examples/demo.py`` drives the class directly, killing and adding
nodes.

etcd runs with authentication on. Before the first child starts,
:func:`rendezvous.etcd.auth.enable_auth` creates the users and roles of
:data:`rendezvous.etcd.auth.ROLES` (the ones ``deploy/etcd/setup-auth.sh``
creates on a real deployment) with passwords kept in ``STATE/etcd-auth/``; the
coordinator runs as ``tidal-coordinator`` and the agents as ``tidal-agent``,
each reading its password from its file (``--etcd-password-file``), so it is
in no process's environment. A write without credentials is refused.

The cluster supervises its coordinator and agents (:mod:`service.up.supervisor`):
one that exits while the cluster runs is started again, on the same port and
node id. etcd itself is not restarted: when it exits, the cluster stops.

The coordinator must stay torch-free and so must this module: agents are never
imported here, they run as ``python -m service.cli agent`` subprocesses.

The children are configured by their flags only: every ``TIDAL_*`` variable is
removed from their environment (:func:`service.up.children.child_env`), so one
meant for this shell (``TIDAL_TOKEN``, ``TIDAL_PORT``, ...) cannot reconfigure
them, and no job's workers inherit the API token.

The state directory's layout and its preparation are :mod:`service.up.state`'s;
the children (a :class:`rendezvous.child.Child` each, with what the supervisor
keeps about it), the restart policy and the waits that watch the children are
:mod:`service.up.children`'s; which children run, and the supervisor thread's
pass over them, are :mod:`service.up.supervisor`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx

from rendezvous.child import stop_all
from rendezvous.errors import EtcdError
from rendezvous.etcd import EtcdConfig
from rendezvous.etcd.auth import ROOT_USER, USERS, enable_auth, find_etcdctl
from rendezvous.etcd.server import EtcdServer
from rendezvous.keys import DEFAULT_ROOT
from service.client.target import AgentEntry, ClusterFile
from service.up.children import (
    DEATH_SIGNAL,
    ChildExit,
    ClusterError,
    RestartPolicy,
    StartCancelledError,
    SupervisedChild,
    wait_until,
)
from service.up.ready import write_atomically
from service.up.state import ChildCommands, StateDir
from service.up.supervisor import Supervisor

log = logging.getLogger(__name__)

DEFAULT_AGENTS = 3
LEASE_TTL_S = 3
HTTP_TIMEOUT_S = 5.0
COORDINATOR_STOP_S = 10.0
_URL_PORT_RE = re.compile(r":(\d+)$")

__all__ = [
    "DEATH_SIGNAL", "DEFAULT_AGENTS", "ChildExit", "ClusterError", "LocalCluster",
    "RestartPolicy", "StartCancelledError",
]


class LocalCluster:
    """etcd, a coordinator and node agents on this machine, as child processes.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Args:
        state_dir: where the token, logs, run directories, etcd's data and
            ``cluster.json`` go (created if missing).
        agents: how many agents :meth:`start` starts (node ids ``node-1`` ..).
        workdir_root: jobs' working directories lie under this (default: the
            current directory).
        checkpoint_root: jobs' checkpoint directories lie under this (default:
            ``STATE/checkpoints``).
        token: the API token; a random one by default. Either way it is written
            to ``STATE/token`` (mode 0600), which the coordinator reads.
        etcd_root: the key prefix in etcd.
        lease_ttl_s: seconds until a silent node counts as gone.
        slots: worker processes each agent may run.
        gpus_per_agent: give each agent this many GPU indices, ``node-i`` the
            i-th run of them (``--gpus``; NVML not needed), so that GPU
            placement works on a machine without GPUs; None: each agent
            finds its GPUs through NVML.
        ready_timeout_s: how long :meth:`start` and :meth:`add_agent` wait.
        stop_grace_s: how long :meth:`stop` waits for agents after SIGTERM.
        python: the interpreter the children run under.
        supervise: start a coordinator or agent again when it dies.
        restart_policy: how soon (see :class:`RestartPolicy`).

    Raises:
        ValueError: an option is out of range.
    """

    def __init__(
        self,
        *,
        state_dir: str | os.PathLike[str],
        agents: int = DEFAULT_AGENTS,
        workdir_root: str | os.PathLike[str] | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
        token: str | None = None,
        etcd_root: str = DEFAULT_ROOT,
        lease_ttl_s: int = LEASE_TTL_S,
        slots: int = 1,
        gpus_per_agent: int | None = None,
        ready_timeout_s: float = 60.0,
        stop_grace_s: float = 15.0,
        python: str = sys.executable,
        supervise: bool = True,
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        if agents < 0:
            raise ValueError(f"agents ({agents}) must not be negative")
        if lease_ttl_s < 2:
            raise ValueError(f"lease_ttl_s ({lease_ttl_s}) must be at least 2")
        if token is not None and len(token.strip()) < 16:
            raise ValueError("the API token must be at least 16 characters")
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.workdir_root = Path(workdir_root or Path.cwd()).expanduser().resolve()
        self.layout = StateDir(self.state_dir)
        self.checkpoint_root = Path(
            checkpoint_root or self.layout.checkpoints_dir
        ).expanduser().resolve()
        self.etcd_root = etcd_root
        self.lease_ttl_s = lease_ttl_s
        self.slots = slots
        if gpus_per_agent is not None and not 0 <= gpus_per_agent <= 64:
            raise ValueError(f"gpus_per_agent ({gpus_per_agent}) must be between 0 and 64")
        self.gpus_per_agent = gpus_per_agent
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python
        self.logs_dir = self.layout.logs_dir
        self.run_root = self.layout.run_root
        self.token_file = self.layout.token_file
        self.cluster_file = self.layout.cluster_file
        self.etcd_auth_dir = self.layout.etcd_auth_dir
        self._commands = ChildCommands(
            layout=self.layout, python=python, etcd_root=etcd_root, lease_ttl_s=lease_ttl_s,
            slots=slots, gpus_per_agent=gpus_per_agent, workdir_root=self.workdir_root,
            checkpoint_root=self.checkpoint_root)
        self.supervise = supervise
        self.restart_policy = restart_policy or RestartPolicy()
        self._initial_agents = agents
        self._token = token.strip() if token is not None else secrets.token_urlsafe(32)
        self._etcd: EtcdServer | None = None
        # The coordinator and agents, and the supervisor thread that restarts them.
        self._children = Supervisor(policy=self.restart_policy, respawn=self._respawn,
                                    on_change=self._children_changed)
        self._next_node = 1
        self._url: str | None = None
        self._started = False
        self._stopped = False
        self._wrote_cluster_file = False  # never remove another cluster's file
        self._coordinator_port = 0  # 0 until the first coordinator serves

    # what it runs ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The coordinator's base URL, ``http://127.0.0.1:PORT``."""
        if self._url is None:
            raise ClusterError("the cluster has not been started")
        return self._url

    @property
    def token(self) -> str:
        """The API bearer token."""
        return self._token

    @property
    def etcd_endpoint(self) -> str:
        """etcd's ``host:port``."""
        if self._etcd is None:
            raise ClusterError("the cluster has not been started")
        return self._etcd.endpoint

    @property
    def etcd_version(self) -> str:
        """The embedded etcd's version, ``?`` before it started."""
        return self._etcd.version_text if self._etcd is not None else "?"

    @property
    def node_ids(self) -> list[str]:
        """The agents this cluster runs (killed ones are gone; one being restarted is not)."""
        with self._children.lock:
            return list(self._children.agents)

    def etcd_password_file(self, user: str) -> Path:
        """The file holding etcd user ``user``'s password (one of :data:`USERS`)."""
        return self.layout.password_file(user)

    def etcd_config(self, user: str = ROOT_USER, *, timeout_s: float = 5.0) -> EtcdConfig:
        """How to reach this cluster's etcd as ``user`` (root by default: everything).

        Raises:
            ClusterError: the cluster has not been started.
        """
        return EtcdConfig(
            endpoints=[self.etcd_endpoint], root=self.etcd_root, timeout_s=timeout_s,
            user=user,
            password=self.etcd_password_file(user).read_text().strip(),  # type: ignore[arg-type]
        )

    def coordinator_pid(self) -> int | None:
        """The pid of the coordinator now running; None while it is being restarted."""
        return self._children.coordinator_pid()

    def restarts(self, name: str) -> int:
        """How many times the supervisor started ``name`` (``coordinator`` or a node id) again."""
        return self._children.restarts(name)

    def client(self, *, timeout: float = HTTP_TIMEOUT_S) -> httpx.Client:
        """An HTTP client for the API: base URL and bearer token set. Close it after use."""
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout,
        )

    def describe(self) -> ClusterFile:
        """What ``cluster.json`` holds."""
        with self._children.lock:
            coordinator = self._children.coordinator
            return ClusterFile(
                url=self.url,
                token_file=self.token_file,
                etcd_endpoint=self.etcd_endpoint,
                etcd_root=self.etcd_root,
                etcd_password_files={u: self.etcd_password_file(u) for u in USERS},
                state_dir=self.state_dir,
                coordinator_pid=coordinator.pid if coordinator else None,
                etcd_pid=self._etcd.pid if self._etcd else None,
                agents=[
                    AgentEntry(node_id=node_id, pid=child.pid,
                               run_dir=child.run_dir or self.layout.run_dir(node_id),
                               metrics_port=child.metrics_port)
                    for node_id, child in self._children.agents.items()
                ],
            )

    # starting -------------------------------------------------------------------------

    def start(self, *, cancel: threading.Event | None = None) -> LocalCluster:
        """Start etcd, the coordinator and the agents; wait until all are ready.

        Args:
            cancel: set it (from a signal handler, say) to give up waiting.

        Raises:
            ClusterError: a part failed to start or was not ready within
                ``ready_timeout_s`` (the message holds the relevant log tails);
                everything started so far has been stopped.
            StartCancelledError: ``cancel`` was set; everything was stopped.
        """
        if self._started:
            raise ClusterError(f"the cluster in {self.state_dir} was started already")
        self._started = True
        try:
            self.layout.prepare(self._token, checkpoint_root=self.checkpoint_root)
            self._start_etcd()
            self._enable_etcd_auth()
            self._children.coordinator = self._spawn("coordinator", self._coordinator_argv())
            for _ in range(self._initial_agents):
                self._spawn_agent()
            deadline = time.monotonic() + self.ready_timeout_s
            self._url = self._wait_for_url(deadline, cancel)
            self._wait_ready(list(self._children.agents), deadline, cancel)
            self._write_cluster_file()
        except BaseException:
            self.stop()
            raise
        if self.supervise:
            self._children.start()
        log.info("tidal is up at %s with %d node(s)", self._url, len(self._children.agents))
        return self

    def _enable_etcd_auth(self) -> None:
        assert self._etcd is not None
        passwords = {u: self.etcd_password_file(u).read_text().strip() for u in USERS}
        try:
            turned_on = enable_auth(
                endpoint=self._etcd.endpoint, root=self.etcd_root, passwords=passwords,
                etcdctl=find_etcdctl(self._etcd.binary),
            )
        except (EtcdError, ValueError) as exc:
            raise ClusterError(
                f"could not set up etcd's users and roles: {exc}. If {self.etcd_auth_dir} "
                f"lost its files after etcd's data had authentication on, remove "
                f"{self.layout.etcd_dir} (it holds the jobs) or restore them"
            ) from exc
        log.info("etcd authentication %s (users %s, passwords in %s)",
                 "turned on" if turned_on else "is on", ", ".join(USERS), self.etcd_auth_dir)

    def _start_etcd(self) -> None:
        data_dir = self.layout.etcd_dir
        data_dir.mkdir(mode=0o700, exist_ok=True)
        try:
            self._etcd = EtcdServer(data_dir=data_dir, parent_death_signal=DEATH_SIGNAL)
            self._etcd.log_path = self.layout.log_file("etcd")
            self._etcd.start()
        except EtcdError as exc:
            raise ClusterError(f"etcd did not start: {exc}") from exc
        log.info("etcd %s at %s (pid %s)", self._etcd.version_text, self._etcd.endpoint,
                 self._etcd.pid)

    def _coordinator_argv(self, port: int = 0) -> list[str]:
        return self._commands.coordinator(self.etcd_endpoint, port)

    def _agent_argv(self, node_id: str, run_dir: Path, metrics_port: int = 0) -> list[str]:
        return self._commands.agent(self.etcd_endpoint, node_id, run_dir, metrics_port)

    def _gpus_argv(self, node_id: str) -> list[str]:
        return self._commands.gpus(node_id)

    def _spawn(self, name: str, argv: list[str], *,
               run_dir: Path | None = None) -> SupervisedChild:
        return SupervisedChild.spawn(name, argv, log_path=self.layout.log_file(name),
                                     ready_file=self.layout.ready_file(name), run_dir=run_dir)

    def _spawn_agent(self) -> str:
        with self._children.lock:
            node_id = f"node-{self._next_node}"
            self._next_node += 1
            run_dir = self.layout.run_dir(node_id)
            run_dir.mkdir(parents=True, exist_ok=True)
            self._children.agents[node_id] = self._spawn(
                node_id, self._agent_argv(node_id, run_dir), run_dir=run_dir)
            return node_id

    def _wait(self, what: str, condition: Callable[[], bool], *, deadline: float,
              cancel: threading.Event | None, watch: list[SupervisedChild]) -> None:
        """:func:`service.up.children.wait_until`, watching etcd too."""
        wait_until(what, condition, deadline=deadline, timeout_s=self.ready_timeout_s,
                   cancel=cancel, watch=watch, etcd=self._etcd)

    def _wait_for_url(self, deadline: float, cancel: threading.Event | None) -> str:
        coordinator = self._children.coordinator
        assert coordinator is not None
        self._wait("the coordinator to serve", coordinator.read_ready, deadline=deadline,
                   cancel=cancel, watch=[coordinator])
        assert coordinator.url is not None
        self._coordinator_port = _port_of(coordinator.url)
        return coordinator.url

    def _wait_ready(
        self, node_ids: list[str], deadline: float, cancel: threading.Event | None
    ) -> None:
        """Wait for /readyz, each agent's metrics port and each node in GET /v1/nodes."""
        assert self._children.coordinator is not None
        agents = [self._children.agents[n] for n in node_ids]
        watch = [self._children.coordinator, *agents]
        with self.client() as http:

            def ready() -> bool:
                return http.get("/readyz").status_code == 200

            self._wait("the coordinator's /readyz", ready, deadline=deadline, cancel=cancel,
                       watch=watch)

            def registered() -> bool:
                if not all([agent.read_ready() for agent in agents]):
                    return False
                response = http.get("/v1/nodes")
                response.raise_for_status()
                listed = {node["node_id"] for node in response.json()}
                return set(node_ids) <= listed

            self._wait(f"node(s) {', '.join(node_ids)} to register", registered,
                       deadline=deadline, cancel=cancel, watch=watch)

    def _write_cluster_file(self) -> None:
        with self._children.lock:
            write_atomically(self.cluster_file, self.describe().model_dump_json(indent=2) + "\n")
            self._wrote_cluster_file = True

    # changing it ----------------------------------------------------------------------

    def add_agent(self) -> str:
        """Start one more agent and wait until its node is registered; return its id.

        Raises:
            ClusterError: it exited or did not register within ``ready_timeout_s``
                (it has been killed).
        """
        if self._url is None or self._stopped:
            raise ClusterError("add_agent needs a running cluster")
        node_id = self._spawn_agent()
        try:
            self._wait_ready([node_id], time.monotonic() + self.ready_timeout_s, None)
        except ClusterError:
            self.kill_agent(node_id)
            raise
        self._write_cluster_file()
        return node_id

    def kill_agent(self, node_id: str) -> None:
        """SIGKILL the agent's process group, as a machine dying would; it is not restarted.

        Its job runners die with it and their workers with them (parent-death
        signal); the node's lease expires after ``lease_ttl_s``.

        Raises:
            ClusterError: no such agent runs.
        """
        with self._children.lock:
            child = self._children.agents.pop(node_id, None)
            if child is None:
                self._children.agent(node_id)  # raises, naming what runs
                return
        child.proc.kill()
        log.info("killed %s (pid %d)", node_id, child.pid)
        if self._wrote_cluster_file and not self._stopped:
            self._write_cluster_file()

    def check(self) -> list[ChildExit]:
        """Children that exited since the last call.

        With ``supervise`` (the default) a dead coordinator or agent is started
        again by the supervisor thread and its exit is reported here as not
        essential; without it, an exited agent is dropped (a lost node) and an
        exited coordinator is essential. etcd's exit is always essential.
        """
        if not self.supervise and not self._stopped:
            with self._children.lock:
                self._children.collect_exits(time.monotonic(), restart=False)
        exits = self._children.take_exits()
        if self._etcd is not None and self._etcd.pid is not None and not self._etcd.running():
            assert self._etcd.process is not None
            exits.append(ChildExit("etcd", self._etcd.pid, self._etcd.process.returncode, True,
                                   self._etcd.log_tail()))
        return exits

    # supervising (service/up/supervisor.py) -------------------------------------------

    def _respawn(self, old: SupervisedChild) -> SupervisedChild:
        """Start ``old`` again: same name, port and node id; a fresh log offset."""
        # A child that died before it was ready (its port taken, say) gets a free port.
        if old is self._children.coordinator:
            port = self._coordinator_port if old.url else 0
            argv = self._coordinator_argv(port)
        else:
            assert old.run_dir is not None
            argv = self._agent_argv(old.name, old.run_dir, old.metrics_port or 0)
        return self._spawn(old.name, argv, run_dir=old.run_dir)

    def _children_changed(self, came_back: list[SupervisedChild]) -> None:
        """Restarted children came back, or an exited agent was dropped."""
        coordinator = self._children.coordinator
        if any(child is coordinator for child in came_back):
            assert coordinator is not None
            if coordinator.url is not None:
                self._url = coordinator.url  # a new port if the old one could not be had
                self._coordinator_port = _port_of(coordinator.url)
        if self._wrote_cluster_file:
            self._write_cluster_file()

    # stopping -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything this cluster started and remove ``cluster.json``; idempotent.

        Agents get SIGTERM (their workers checkpoint and leave their jobs) and
        SIGKILL after ``stop_grace_s``; then the coordinator; then etcd. Each
        child's whole process group goes (a runner between signals, say).
        """
        if self._stopped:
            return
        self._children.stop()
        with self._children.lock:
            self._stopped = True
            agents = list(self._children.agents.values())
            self._children.agents.clear()
        stop_all([child.proc for child in agents], self.stop_grace_s)
        if self._children.coordinator is not None:
            self._children.coordinator.proc.stop(COORDINATOR_STOP_S)
        if self._etcd is not None:
            self._etcd.stop()
        if self._wrote_cluster_file:
            with contextlib.suppress(FileNotFoundError):
                self.cluster_file.unlink()
        log.info("stopped the cluster in %s", self.state_dir)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _port_of(url: str) -> int:
    match = _URL_PORT_RE.search(url.rstrip("/"))
    if match is None:
        raise ClusterError(f"the coordinator's URL {url!r} has no port")
    return int(match.group(1))
