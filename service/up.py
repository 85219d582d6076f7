"""`tidal up`: a whole tidal cluster on this machine, from one command.

:class:`LocalCluster` starts an embedded etcd, one coordinator and N node
agents as child processes, each in a process group of its own with its output
in ``STATE/logs/<name>.log``; waits until the API answers ``/readyz`` and every
node has registered; and writes ``STATE/cluster.json`` (address, token file,
pids) for the CLI and for scripts. :meth:`LocalCluster.stop` stops what it
started in order: the agents (SIGTERM, so their workers checkpoint; SIGKILL
after a grace), the coordinator, then etcd. :func:`up_command` is ``tidal up``
around it; ``examples/demo.py`` drives the class directly, killing and adding
nodes.

The coordinator must stay torch-free and so must this module: agents are never
imported here, they run as ``python -m service.cli agent`` subprocesses.

The children are configured by their flags only: every ``TIDAL_*`` variable is
removed from their environment, so one meant for this shell (``TIDAL_TOKEN``,
``TIDAL_PORT``, ...) cannot reconfigure them, and no job's workers inherit the
API token.

The state directory::

    STATE/token          the API token (mode 0600)
    STATE/cluster.json   what runs now; removed on a clean stop
    STATE/etcd/          etcd's data, kept: jobs outlive a restart of `tidal up`
    STATE/logs/          etcd.log, coordinator.log, node-<i>.log
    STATE/run/node-<i>/  each agent's run directory (its jobs' worker logs)
    STATE/checkpoints/   the default checkpoint root
    STATE/prometheus/    with --prometheus: its configuration, agent targets and data
                         (service/prometheus.py); its output in STATE/logs/prometheus.log
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import click
import httpx

from rendezvous.errors import EtcdError
from rendezvous.etcd_server import EtcdServer
from service.prometheus import LocalPrometheus, PrometheusError, target_of

log = logging.getLogger(__name__)

DEFAULT_AGENTS = 3
DEFAULT_ETCD_ROOT = "/tidal"
LEASE_TTL_S = 3
CLUSTER_FILE = "cluster.json"
TOKEN_FILE = "token"  # noqa: S105 (a file name, not a secret)
HTTP_TIMEOUT_S = 5.0
COORDINATOR_STOP_S = 10.0

# The coordinator prints its URL (its port may have been 0) and the agent logs
# its metrics port (0 too: the kernel picks a free one, no probing race).
_SERVING_RE = re.compile(r"tidal coordinator serving on (http://\S+)")
_METRICS_RE = re.compile(r"metrics on :(\d+)/metrics")


class ClusterError(Exception):
    """The local cluster could not start, or lost a part it cannot run without."""


class StartCancelledError(ClusterError):
    """:meth:`LocalCluster.start` was told to give up (Ctrl-C or SIGTERM while starting)."""


def default_state_dir() -> Path:
    """``$TIDAL_HOME``, else ``~/.tidal``."""
    home = os.environ.get("TIDAL_HOME")
    return Path(home).expanduser() if home else Path.home() / ".tidal"


@dataclass
class _Child:
    """One process this cluster started, in its own process group."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_offset: int  # where this run's output starts in an appended log
    run_dir: Path | None = None  # agents only
    metrics_port: int | None = None  # agents only, once logged

    @property
    def pid(self) -> int:
        return self.process.pid

    def new_output(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        text = self.new_output().splitlines()[-lines:]
        return f"--- last lines of {self.log_path} ---\n" + ("\n".join(text) or "(empty)")


@dataclass(frozen=True)
class ChildExit:
    """A child that exited while the cluster ran.

    Attributes:
        name: ``etcd``, ``coordinator`` or the node id.
        pid: its process id.
        returncode: its exit status (negative: killed by that signal).
        essential: the cluster cannot go on without it (etcd, the coordinator);
            a lost agent is a lost node, which tidal is built to survive.
        log_tail: the last lines of its log.
    """

    name: str
    pid: int
    returncode: int | None
    essential: bool
    log_tail: str


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}


def _write_atomically(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Write ``path`` through a temporary file and a rename: readers never see half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # O_CREAT's mode is masked by the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _is_coordinator(pid: int) -> bool:
    """True if ``pid`` lives and runs a tidal coordinator (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: trust the pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return b"service.cli" in cmdline and b"coordinator" in cmdline


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
        ready_timeout_s: how long :meth:`start` and :meth:`add_agent` wait.
        stop_grace_s: how long :meth:`stop` waits for agents after SIGTERM.
        python: the interpreter the children run under.

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
        etcd_root: str = DEFAULT_ETCD_ROOT,
        lease_ttl_s: int = LEASE_TTL_S,
        slots: int = 1,
        ready_timeout_s: float = 60.0,
        stop_grace_s: float = 15.0,
        python: str = sys.executable,
    ) -> None:
        if agents < 0:
            raise ValueError(f"agents ({agents}) must not be negative")
        if lease_ttl_s < 2:
            raise ValueError(f"lease_ttl_s ({lease_ttl_s}) must be at least 2")
        if token is not None and len(token.strip()) < 16:
            raise ValueError("the API token must be at least 16 characters")
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.workdir_root = Path(workdir_root or Path.cwd()).expanduser().resolve()
        self.checkpoint_root = Path(
            checkpoint_root or self.state_dir / "checkpoints"
        ).expanduser().resolve()
        self.etcd_root = etcd_root
        self.lease_ttl_s = lease_ttl_s
        self.slots = slots
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python
        self.logs_dir = self.state_dir / "logs"
        self.run_root = self.state_dir / "run"
        self.token_file = self.state_dir / TOKEN_FILE
        self.cluster_file = self.state_dir / CLUSTER_FILE
        self._initial_agents = agents
        self._token = token.strip() if token is not None else secrets.token_urlsafe(32)
        self._etcd: EtcdServer | None = None
        self._coordinator: _Child | None = None
        self._agents: dict[str, _Child] = {}
        self._next_node = 1
        self._url: str | None = None
        self._started = False
        self._stopped = False
        self._wrote_cluster_file = False  # never remove another cluster's file

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
        """The agents this cluster runs now (killed or exited ones are gone)."""
        return list(self._agents)

    def agent_pid(self, node_id: str) -> int:
        """The pid (and process group) of ``node_id``'s agent.

        Raises:
            ClusterError: no such agent runs.
        """
        return self._agent(node_id).pid

    def agent_run_dir(self, node_id: str) -> Path:
        """``node_id``'s run directory (its jobs' runner and worker logs).

        Raises:
            ClusterError: no such agent runs.
        """
        run_dir = self._agent(node_id).run_dir
        assert run_dir is not None
        return run_dir

    def client(self, *, timeout: float = HTTP_TIMEOUT_S) -> httpx.Client:
        """An HTTP client for the API: base URL and bearer token set. Close it after use."""
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout,
        )

    def describe(self) -> dict[str, Any]:
        """What ``cluster.json`` holds."""
        return {
            "url": self.url,
            "token_file": str(self.token_file),
            "etcd_endpoint": self.etcd_endpoint,
            "etcd_root": self.etcd_root,
            "state_dir": str(self.state_dir),
            "coordinator_pid": self._coordinator.pid if self._coordinator else None,
            "etcd_pid": self._etcd.pid if self._etcd else None,
            "agents": [
                {
                    "node_id": node_id,
                    "pid": child.pid,
                    "run_dir": str(child.run_dir),
                    "metrics_port": child.metrics_port,
                }
                for node_id, child in self._agents.items()
            ],
        }

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
            self._prepare_state_dir()
            self._start_etcd()
            self._coordinator = self._spawn("coordinator", self._coordinator_argv())
            for _ in range(self._initial_agents):
                self._spawn_agent()
            deadline = time.monotonic() + self.ready_timeout_s
            self._url = self._wait_for_url(deadline, cancel)
            self._wait_ready(list(self._agents), deadline, cancel)
            self._write_cluster_file()
        except BaseException:
            self.stop()
            raise
        log.info("tidal is up at %s with %d node(s)", self._url, len(self._agents))
        return self

    def _prepare_state_dir(self) -> None:
        for path in (self.state_dir, self.logs_dir, self.run_root, self.checkpoint_root):
            path.mkdir(parents=True, exist_ok=True)
        if self.cluster_file.exists():
            try:
                previous = json.loads(self.cluster_file.read_text())
                pid = int(previous.get("coordinator_pid") or 0)
            except (OSError, ValueError, AttributeError):
                pid = 0
            if pid and _is_coordinator(pid):
                raise ClusterError(
                    f"a tidal cluster already runs from {self.state_dir} (coordinator pid "
                    f"{pid}, {previous.get('url')}); stop it first or use another --state-dir"
                )
            log.info("removing the stale %s of a cluster that is gone", self.cluster_file)
            self.cluster_file.unlink()
        _write_atomically(self.token_file, self._token + "\n", mode=0o600)

    def _start_etcd(self) -> None:
        data_dir = self.state_dir / "etcd"
        data_dir.mkdir(mode=0o700, exist_ok=True)
        try:
            self._etcd = EtcdServer(data_dir=data_dir)
            self._etcd.log_path = self.logs_dir / "etcd.log"
            self._etcd.start()
        except EtcdError as exc:
            raise ClusterError(f"etcd did not start: {exc}") from exc
        log.info("etcd %s at %s (pid %s)", self._etcd.version_text, self._etcd.endpoint,
                 self._etcd.pid)

    def _coordinator_argv(self) -> list[str]:
        return [
            self.python, "-m", "service.cli", "coordinator",
            "--etcd", self.etcd_endpoint,
            "--etcd-root", self.etcd_root,
            "--host", "127.0.0.1",
            "--port", "0",
            "--token-file", str(self.token_file),
            "--workdir-root", str(self.workdir_root),
            "--checkpoint-root", str(self.checkpoint_root),
        ]

    def _spawn(self, name: str, argv: list[str], *, run_dir: Path | None = None) -> _Child:
        log_path = self.logs_dir / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                start_new_session=True,  # its own process group, stopped as a whole
            )
        log.info("started %s (pid %d), log %s", name, process.pid, log_path)
        return _Child(name, process, log_path, offset, run_dir=run_dir)

    def _spawn_agent(self) -> str:
        node_id = f"node-{self._next_node}"
        self._next_node += 1
        run_dir = self.run_root / node_id
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.python, "-m", "service.cli", "agent",
            "--etcd", self.etcd_endpoint,
            "--etcd-root", self.etcd_root,
            "--node-id", node_id,
            "--run-dir", str(run_dir),
            "--lease-ttl", str(self.lease_ttl_s),
            "--metrics-port", "0",
            "--slots", str(self.slots),
        ]
        self._agents[node_id] = self._spawn(node_id, argv, run_dir=run_dir)
        return node_id

    def _wait(
        self,
        what: str,
        condition: Callable[[], bool],
        *,
        deadline: float,
        cancel: threading.Event | None,
        watch: Iterable[_Child],
    ) -> None:
        """Poll ``condition`` until true; fail fast if a watched child exits.

        Raises:
            StartCancelledError: ``cancel`` was set.
            ClusterError: a watched child exited, or the deadline passed; with log tails.
        """
        watched = list(watch)
        last: object = None
        while True:
            if cancel is not None and cancel.is_set():
                raise StartCancelledError(f"stopped while waiting for {what}")
            if self._etcd is not None and not self._etcd.running():
                raise ClusterError(
                    f"etcd exited while waiting for {what}; log tail:\n{self._etcd.log_tail()}"
                )
            for child in watched:
                code = child.process.poll()
                if code is not None:
                    raise ClusterError(
                        f"{child.name} (pid {child.pid}) exited with code {code} while "
                        f"waiting for {what}\n{child.tail()}"
                    )
            try:
                if condition():
                    return
                last = None
            except (httpx.HTTPError, ValueError) as exc:
                last = exc
            if time.monotonic() > deadline:
                tails = "\n".join(child.tail() for child in watched)
                raise ClusterError(
                    f"timed out after {self.ready_timeout_s:g} s waiting for {what}"
                    + (f" (last error: {last})" if last else "") + f"\n{tails}"
                )
            time.sleep(0.1)

    def _wait_for_url(self, deadline: float, cancel: threading.Event | None) -> str:
        coordinator = self._coordinator
        assert coordinator is not None
        found: list[str] = []

        def serving() -> bool:
            match = _SERVING_RE.search(coordinator.new_output())
            if match:
                found.append(match.group(1))
            return match is not None

        self._wait("the coordinator to serve", serving, deadline=deadline, cancel=cancel,
                   watch=[coordinator])
        return found[0]

    def _wait_ready(
        self, node_ids: list[str], deadline: float, cancel: threading.Event | None
    ) -> None:
        """Wait for /readyz, each agent's metrics port and each node in GET /v1/nodes."""
        assert self._coordinator is not None
        agents = [self._agents[n] for n in node_ids]
        watch = [self._coordinator, *agents]
        with self.client() as http:

            def ready() -> bool:
                return http.get("/readyz").status_code == 200

            self._wait("the coordinator's /readyz", ready, deadline=deadline, cancel=cancel,
                       watch=watch)

            def registered() -> bool:
                for agent in agents:
                    if agent.metrics_port is None:
                        match = _METRICS_RE.search(agent.new_output())
                        agent.metrics_port = int(match.group(1)) if match else None
                response = http.get("/v1/nodes")
                response.raise_for_status()
                listed = {node["node_id"] for node in response.json()}
                return set(node_ids) <= listed and all(a.metrics_port for a in agents)

            self._wait(f"node(s) {', '.join(node_ids)} to register", registered,
                       deadline=deadline, cancel=cancel, watch=watch)

    def _write_cluster_file(self) -> None:
        _write_atomically(self.cluster_file, json.dumps(self.describe(), indent=2) + "\n")
        self._wrote_cluster_file = True

    # changing it ----------------------------------------------------------------------

    def _agent(self, node_id: str) -> _Child:
        try:
            return self._agents[node_id]
        except KeyError:
            raise ClusterError(
                f"no agent {node_id!r} runs in this cluster (running: "
                f"{', '.join(self._agents) or 'none'})"
            ) from None

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
        """SIGKILL the agent's process group, as a machine dying would.

        Its job runners die with it and their workers with them (parent-death
        signal); the node's lease expires after ``lease_ttl_s``.

        Raises:
            ClusterError: no such agent runs.
        """
        child = self._agents.pop(node_id, None)
        if child is None:
            self._agent(node_id)  # raises, naming what runs
            return
        _signal_group(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=10)
        log.info("killed %s (pid %d)", node_id, child.pid)
        if self._wrote_cluster_file and not self._stopped:
            self._write_cluster_file()

    def check(self) -> list[ChildExit]:
        """Children that exited since the last call.

        An exited agent is dropped from the cluster (its process group is
        SIGKILLed in case anything of it lingers) and from ``cluster.json``.
        """
        exits: list[ChildExit] = []
        for node_id, child in list(self._agents.items()):
            code = child.process.poll()
            if code is not None:
                del self._agents[node_id]
                _signal_group(child.pid, signal.SIGKILL)
                exits.append(ChildExit(node_id, child.pid, code, False, child.tail()))
        if exits and self._wrote_cluster_file and not self._stopped:
            self._write_cluster_file()
        coordinator = self._coordinator
        if coordinator is not None and coordinator.process.poll() is not None:
            exits.append(ChildExit("coordinator", coordinator.pid,
                                   coordinator.process.returncode, True, coordinator.tail()))
        if self._etcd is not None and self._etcd.pid is not None and not self._etcd.running():
            assert self._etcd.process is not None
            exits.append(ChildExit("etcd", self._etcd.pid, self._etcd.process.returncode, True,
                                   self._etcd.log_tail()))
        return exits

    # stopping -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything this cluster started and remove ``cluster.json``; idempotent.

        Agents get SIGTERM (their workers checkpoint and leave their jobs) and
        SIGKILL after ``stop_grace_s``; then the coordinator; then etcd.
        """
        if self._stopped:
            return
        self._stopped = True
        agents = list(self._agents.values())
        self._agents.clear()
        for child in agents:
            _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for child in agents:
            self._reap(child, deadline)
        if self._coordinator is not None:
            _signal_group(self._coordinator.pid, signal.SIGTERM)
            self._reap(self._coordinator, time.monotonic() + COORDINATOR_STOP_S)
        if self._etcd is not None:
            self._etcd.stop()
        if self._wrote_cluster_file:
            with contextlib.suppress(FileNotFoundError):
                self.cluster_file.unlink()
        log.info("stopped the cluster in %s", self.state_dir)

    @staticmethod
    def _reap(child: _Child, deadline: float) -> None:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop in time; killing it", child.name, child.pid)
        # Whatever is left of its group (a runner between signals, say) goes too.
        _signal_group(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=10)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# the command --------------------------------------------------------------------------


def _example_submit(cluster: LocalCluster) -> str:
    body = json.dumps({"name": "hello", "command": ["echo", "hello from tidal"]})
    return (
        f'curl -sS -H "Authorization: Bearer $(cat {shlex.quote(str(cluster.token_file))})" '
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)} {cluster.url}/v1/jobs"
    )


def _announce(cluster: LocalCluster, prometheus: LocalPrometheus | None = None) -> None:
    nodes = ", ".join(cluster.node_ids) or "none"
    click.echo(f"tidal is up: coordinator at {cluster.url}, node(s) {nodes}")
    click.echo(f"  API token:  {cluster.token_file}")
    click.echo(f"  etcd:       {cluster.etcd_endpoint} (etcd {cluster.etcd_version})")
    click.echo(f"  logs:       {cluster.logs_dir}/ (etcd, coordinator, node-<i>); "
               f"workers' logs under {cluster.run_root}/<node>/jobs/")
    click.echo(f"  state:      {cluster.cluster_file}")
    if prometheus is not None:
        click.echo(f"  prometheus: {prometheus.url} (scrapes the coordinator and every agent; "
                   f"log {prometheus.log_path})")
    click.echo("Submit a job:")
    click.echo(f"  {_example_submit(cluster)}")
    click.echo("Ctrl-C stops everything.")


@click.command("up")
@click.option("--agents", "agent_count", type=click.IntRange(0, 256), default=DEFAULT_AGENTS,
              show_default=True, help="Node agents to start (node-1 .. node-N).")
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), envvar="TIDAL_HOME",
              default=None, help="Token, logs, run dirs, etcd data, cluster.json "
              "(default: $TIDAL_HOME, else ~/.tidal).")
@click.option("--workdir-root", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None, help="Jobs' working directories lie under this (default: the "
              "current directory).")
@click.option("--checkpoint-root", type=click.Path(path_type=Path, file_okay=False),
              default=None, help="Jobs' checkpoint directories lie under this "
              "(default: STATE/checkpoints).")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=1), default=60.0,
              show_default=True, help="Seconds to wait for the cluster to be ready.")
@click.option("--prometheus", "with_prometheus", is_flag=True, default=False,
              help="Also run a local Prometheus (the `prometheus` binary on PATH) scraping the "
              "coordinator and every agent, with tidal's alerting rules; prints its URL.")
def up_command(
    agent_count: int,
    state_dir: Path | None,
    workdir_root: Path | None,
    checkpoint_root: Path | None,
    ready_timeout_s: float,
    with_prometheus: bool,
) -> None:
    """Run etcd, a coordinator and node agents on this machine until interrupted.

    The API token is $TIDAL_TOKEN if set, else a random one; either way it is
    written to STATE/token. What runs is described in STATE/cluster.json.
    """
    try:
        cluster = LocalCluster(
            state_dir=state_dir or default_state_dir(),
            agents=agent_count,
            workdir_root=workdir_root,
            checkpoint_root=checkpoint_root,
            token=os.environ.get("TIDAL_TOKEN") or None,
            ready_timeout_s=ready_timeout_s,
        )
        prometheus = LocalPrometheus(
            directory=cluster.state_dir / "prometheus",
            log_path=cluster.logs_dir / "prometheus.log",
            ready_timeout_s=ready_timeout_s,
        ) if with_prometheus else None
    except (ValueError, PrometheusError) as exc:
        raise click.ClickException(str(exc)) from exc
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    failure: str | None = None
    try:
        cluster.start(cancel=stop)
        if prometheus is not None:
            agents = [f"127.0.0.1:{a['metrics_port']}" for a in cluster.describe()["agents"]]
            prometheus.start(coordinator=target_of(cluster.url), agents=agents)
        _announce(cluster, prometheus)
        while failure is None and not stop.wait(0.5):
            failure = _report_exits(cluster.check())
    except StartCancelledError:
        pass  # stopped by a signal while starting: not an error
    except (ClusterError, PrometheusError) as exc:
        failure = str(exc)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the stop below is bounded; let it finish
        if received:
            click.echo(f"{received[0]}: stopping everything", err=True)
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()
    if failure is not None:
        raise click.ClickException(failure)
    click.echo("stopped", err=True)


def _report_exits(exits: list[ChildExit]) -> str | None:
    """Say which children died; return an error message if the cluster cannot go on."""
    for ex in exits:
        if ex.essential:
            return (f"the {ex.name} (pid {ex.pid}) exited with code {ex.returncode}; "
                    f"stopping everything\n{ex.log_tail}")
        click.echo(f"agent {ex.name} (pid {ex.pid}) exited with code {ex.returncode}: "
                   "a lost node; its jobs go on without it", err=True)
    return None
