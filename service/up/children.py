"""`tidal up`'s children and their supervision: what :class:`service.up.cluster.LocalCluster`
knows about each process it started, when a dead one starts again, and how its
exit is reported.

A :class:`SupervisedChild` is a :class:`rendezvous.child.Child` (the one way tidal
starts and stops a child process: its own session and process group, the
parent-death signal, SIGTERM then SIGKILL of the group, its log since its start)
with what the cluster's supervisor keeps about it: its ready file (the child says
it is ready there, :mod:`service.up.ready`, never through its log text), the port it
serves on, and its deaths and restarts. :class:`RestartPolicy` decides how soon a
dead child starts again; :meth:`SupervisedChild.note_exit` notes a death and
schedules the restart; :class:`ChildExit` is how an exit is reported to
``tidal up``. :func:`wait_until` is the wait for a condition that gives up as soon
as a watched child (or etcd) exits.

Which children there are, their command lines and what a restart changes in the
cluster (its URL, ``cluster.json``) stay with :class:`service.up.cluster.LocalCluster`.
Like it, this module never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from rendezvous.child import Child
from rendezvous.etcd.server import EtcdServer
from service.up.ready import ReadyFile, read_ready

log = logging.getLogger(__name__)

# What each child gets from the kernel when `tidal up` dies without stopping it
# (SIGKILL): its own session puts it out of reach of a signal to our group.
# SIGTERM: an agent still stops its runners, whose workers save.
DEATH_SIGNAL = signal.SIGTERM
WAIT_POLL_S = 0.1


class ClusterError(Exception):
    """The local cluster could not start, or lost a part it cannot run without."""


class StartCancelledError(ClusterError):
    """:meth:`LocalCluster.start` was told to give up (Ctrl-C or SIGTERM while starting)."""


@dataclass(frozen=True)
class RestartPolicy:
    """When to start a child again that died.

    The first restart comes after ``base_s``; each further death of a child
    that ran less than ``stable_s`` doubles the delay, up to ``max_s``, which
    bounds the restart rate of a child that keeps dying. A child that ran
    ``stable_s`` or longer starts the count again.
    """

    base_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0

    def next_delay(self, *, quick_deaths: int, ran_s: float) -> tuple[float, int]:
        """The delay before the next start, and the count of quick deaths to keep.

        Args:
            quick_deaths: deaths in a row, before this one, of a child that
                ran less than ``stable_s``.
            ran_s: how long the child ran this time.
        """
        deaths = 0 if ran_s >= self.stable_s else quick_deaths
        return min(self.max_s, self.base_s * 2.0 ** min(deaths, 32)), deaths + 1


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


def child_env() -> dict[str, str]:
    """This process's environment less every ``TIDAL_*`` variable: a child is
    configured by its flags only, and no job's workers inherit the API token."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}


@dataclass
class SupervisedChild:
    """One process the cluster started, in its own process group."""

    name: str
    proc: Child  # the process, its group and its log
    ready_file: Path
    started_at: float  # monotonic
    run_dir: Path | None = None  # agents only
    metrics_port: int | None = None  # agents only, from the ready file
    url: str | None = None  # the coordinator only, from the ready file
    # Supervision: set while it is dead and waiting to be started again.
    restart_at: float | None = None
    quick_deaths: int = 0
    restarts: int = 0

    @classmethod
    def spawn(cls, name: str, argv: list[str], *, log_path: Path, ready_file: Path,
              run_dir: Path | None = None) -> SupervisedChild:
        """Start ``argv`` (never a shell) with :func:`child_env`, its output appended to
        ``log_path``; a ready file left by an earlier incarnation is removed first."""
        with contextlib.suppress(FileNotFoundError):
            ready_file.unlink()
        proc = Child.spawn(name, argv, log_path, env=child_env(),
                           parent_death_signal=DEATH_SIGNAL)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return cls(name, proc, ready_file, time.monotonic(), run_dir=run_dir)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def read_ready(self) -> bool:
        """True once the ready file of this incarnation is there (sets url/metrics_port)."""
        ready: ReadyFile | None = read_ready(self.ready_file, self.pid)
        if ready is None:
            return False
        self.url = ready.url or self.url
        self.metrics_port = ready.metrics_port or self.metrics_port
        return True

    def tail(self, lines: int = 30) -> str:
        text = self.proc.log_tail(lines)
        return f"--- last lines of {self.log_path} ---\n" + (text or "(empty)")

    def note_exit(self, now: float, policy: RestartPolicy | None, *,
                  essential: bool = False) -> ChildExit | None:
        """If it has exited since the last call: kill what is left of its group and
        report the exit; with a ``policy``, schedule its restart (:attr:`restart_at`).

        None while it runs, or while it is dead already and waits for its restart.
        """
        if self.restart_at is not None:
            return None  # dead already, waiting for its restart
        code = self.proc.poll()
        if code is None:
            return None
        self.proc.signal(signal.SIGKILL)  # whatever is left of its group
        exit_ = ChildExit(self.name, self.pid, code, essential, self.tail())
        if policy is not None:
            delay, self.quick_deaths = policy.next_delay(
                quick_deaths=self.quick_deaths, ran_s=now - self.started_at)
            self.restart_at = now + delay
            log.warning("%s (pid %d) exited with code %s; starting it again in %.1f s",
                        self.name, self.pid, code, delay)
        return exit_

    def restart_due(self, now: float) -> bool:
        """Dead, and its restart's time has come."""
        return self.restart_at is not None and now >= self.restart_at

    def came_back(self) -> bool:
        """A restarted incarnation that runs and has just said it is ready (once)."""
        return (self.restart_at is None and self.restarts > 0 and self.proc.poll() is None
                and not self.url and not self.metrics_port and self.read_ready())

    def succeeded_by(self, new: SupervisedChild) -> SupervisedChild:
        """``new``, the next incarnation of this child, with its deaths and restarts counted."""
        new.quick_deaths = self.quick_deaths
        new.restarts = self.restarts + 1
        log.warning("started %s again (pid %d, restart %d)", new.name, new.pid, new.restarts)
        return new


def wait_until(
    what: str,
    condition: Callable[[], bool],
    *,
    deadline: float,
    timeout_s: float,
    cancel: threading.Event | None,
    watch: Iterable[SupervisedChild],
    etcd: EtcdServer | None,
) -> None:
    """Poll ``condition`` until true; fail fast if etcd or a watched child exits.

    Args:
        what: what is waited for, for the messages.
        condition: may raise ``httpx.HTTPError`` or ``ValueError`` (not yet).
        deadline: monotonic time to give up at.
        timeout_s: the wait's length, for the message.
        cancel: set it to give up at once.
        watch: the children whose exit ends the wait.
        etcd: the cluster's etcd, if started.

    Raises:
        StartCancelledError: ``cancel`` was set.
        ClusterError: a watched child exited, or the deadline passed; with log tails.
    """
    watched = list(watch)
    last: object = None
    while True:
        if cancel is not None and cancel.is_set():
            raise StartCancelledError(f"stopped while waiting for {what}")
        if etcd is not None and not etcd.running():
            raise ClusterError(
                f"etcd exited while waiting for {what}; log tail:\n{etcd.log_tail()}"
            )
        for child in watched:
            code = child.proc.poll()
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
                f"timed out after {timeout_s:g} s waiting for {what}"
                + (f" (last error: {last})" if last else "") + f"\n{tails}"
            )
        time.sleep(WAIT_POLL_S)
