"""The state directory of `tidal up`: where each of its files lies, its preparation,
and the command lines that point the cluster's children at it.

:class:`StateDir` is the one home of the layout; :class:`service.up.cluster.LocalCluster`
builds every path through it, and :meth:`StateDir.prepare` makes the directory
ready for a start: it refuses one whose cluster still runs, removes a stale
``cluster.json``, writes the API token and makes the etcd passwords that are
missing. :class:`ChildCommands` builds the coordinator's and the agents' command
lines (``python -m service.cli coordinator|agent`` with their flags: the children
are configured by their flags only). ``cluster.json``'s name and model are
:mod:`service.client.target`'s, shared with the client that reads it. The layout::

    STATE/token          the API token (mode 0600)
    STATE/cluster.json   what runs now; removed on a clean stop
    STATE/etcd/          etcd's data, kept: jobs outlive a restart of `tidal up`
    STATE/etcd-auth/     etcd passwords: root, tidal-coordinator, tidal-agent
                         (directory 0700, files 0600); kept with etcd's data
    STATE/logs/          etcd.log, coordinator.log, node-<i>.log
    STATE/run/node-<i>/  each agent's run directory (its jobs' worker logs)
    STATE/run/<name>.ready.json  each child's ready file (service/up/ready.py)
    STATE/checkpoints/   the default checkpoint root
    STATE/prometheus/    with --prometheus: its configuration, agent targets and data
                         (service/up/prometheus.py); its output in STATE/logs/prometheus.log
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from rendezvous.etcd.auth import AGENT_USER, COORDINATOR_USER, USERS
from service.client.target import CLUSTER_FILE
from service.up.children import ClusterError
from service.up.ready import write_atomically

log = logging.getLogger(__name__)

TOKEN_FILE = "token"  # noqa: S105 (a file name, not a secret)
ETCD_AUTH_DIR = "etcd-auth"


def is_coordinator(pid: int) -> bool:
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


@dataclass(frozen=True)
class StateDir:
    """The paths under ``root`` (an absolute directory) that a local cluster uses."""

    root: Path

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def run_root(self) -> Path:
        return self.root / "run"

    @property
    def token_file(self) -> Path:
        return self.root / TOKEN_FILE

    @property
    def cluster_file(self) -> Path:
        return self.root / CLUSTER_FILE

    @property
    def etcd_dir(self) -> Path:
        return self.root / "etcd"

    @property
    def etcd_auth_dir(self) -> Path:
        return self.root / ETCD_AUTH_DIR

    @property
    def checkpoints_dir(self) -> Path:
        """The default checkpoint root."""
        return self.root / "checkpoints"

    def log_file(self, name: str) -> Path:
        """The log of child ``name`` (``etcd``, ``coordinator``, a node id)."""
        return self.logs_dir / f"{name}.log"

    def ready_file(self, name: str) -> Path:
        """Where child ``name`` says it is ready (:mod:`service.up.ready`)."""
        return self.run_root / f"{name}.ready.json"

    def run_dir(self, node_id: str) -> Path:
        """The run directory of the agent of ``node_id``."""
        return self.run_root / node_id

    def password_file(self, user: str) -> Path:
        """The file holding etcd user ``user``'s password (one of :data:`USERS`)."""
        if user not in USERS:
            raise ValueError(f"no etcd user {user!r} in a local cluster (users: {USERS})")
        return self.etcd_auth_dir / user

    def prepare(self, token: str, *, checkpoint_root: Path) -> None:
        """Make the directories, write the token and the missing etcd passwords.

        Raises:
            ClusterError: a cluster started from this directory still runs.
        """
        for path in (self.root, self.logs_dir, self.run_root, checkpoint_root):
            path.mkdir(parents=True, exist_ok=True)
        if self.cluster_file.exists():
            self._remove_stale_cluster_file()
        write_atomically(self.token_file, token + "\n", mode=0o600)
        self._prepare_etcd_passwords()

    def _remove_stale_cluster_file(self) -> None:
        try:
            previous = json.loads(self.cluster_file.read_text())
            pid = int(previous.get("coordinator_pid") or 0)
        except (OSError, ValueError, AttributeError):
            pid = 0
        if pid and is_coordinator(pid):
            raise ClusterError(
                f"a tidal cluster already runs from {self.root} (coordinator pid "
                f"{pid}, {previous.get('url')}); stop it first or use another --state-dir"
            )
        log.info("removing the stale %s of a cluster that is gone", self.cluster_file)
        self.cluster_file.unlink()

    def _prepare_etcd_passwords(self) -> None:
        """Make a password for each etcd user that has none yet; keep existing ones
        (etcd's data, kept across runs, has them)."""
        self.etcd_auth_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.etcd_auth_dir, 0o700)
        for user in USERS:
            path = self.password_file(user)
            if not path.exists():
                write_atomically(path, secrets.token_hex(24) + "\n", mode=0o600)
            else:
                os.chmod(path, 0o600)


@dataclass(frozen=True)
class ChildCommands:
    """The command lines of a local cluster's coordinator and agents."""

    layout: StateDir
    python: str  # the interpreter the children run under
    etcd_root: str
    lease_ttl_s: int
    slots: int
    gpus_per_agent: int | None
    workdir_root: Path
    checkpoint_root: Path

    def coordinator(self, etcd_endpoint: str, port: int = 0) -> list[str]:
        """``tidal coordinator`` on ``127.0.0.1:port`` (0: a free port, in its ready file)."""
        return [
            self.python, "-m", "service.cli", "coordinator",
            "--etcd", etcd_endpoint,
            "--etcd-root", self.etcd_root,
            "--etcd-user", COORDINATOR_USER,
            "--etcd-password-file", str(self.layout.password_file(COORDINATOR_USER)),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--token-file", str(self.layout.token_file),
            "--workdir-root", str(self.workdir_root),
            "--checkpoint-root", str(self.checkpoint_root),
            "--ready-file", str(self.layout.ready_file("coordinator")),
        ]

    def agent(self, etcd_endpoint: str, node_id: str, run_dir: Path,
              metrics_port: int = 0) -> list[str]:
        """``tidal agent`` for ``node_id``, its metrics on ``127.0.0.1:metrics_port``."""
        return [
            self.python, "-m", "service.cli", "agent",
            "--etcd", etcd_endpoint,
            "--etcd-root", self.etcd_root,
            "--etcd-user", AGENT_USER,
            "--etcd-password-file", str(self.layout.password_file(AGENT_USER)),
            "--node-id", node_id,
            "--run-dir", str(run_dir),
            "--lease-ttl", str(self.lease_ttl_s),
            "--metrics-host", "127.0.0.1",
            "--metrics-port", str(metrics_port),
            "--slots", str(self.slots),
            *self.gpus(node_id),
            "--ready-file", str(self.layout.ready_file(node_id)),
        ]

    def gpus(self, node_id: str) -> list[str]:
        """``--gpus`` for ``node-i``: the i-th run of ``gpus_per_agent`` indices."""
        if self.gpus_per_agent is None:
            return []
        count = self.gpus_per_agent
        number = int(node_id.rpartition("-")[2])
        first = (number - 1) * count
        return ["--gpus", ",".join(str(i) for i in range(first, first + count)) or "none"]
