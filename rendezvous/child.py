"""One way to run a child process that must be stopped as a whole: etcd, Prometheus, `tidal up`'s.

A :class:`Child` runs in its own process group (``start_new_session``), so a
signal reaches everything it started; its output is appended to a log file,
and :meth:`Child.log_tail` reads what it wrote since it was started, for error
messages. :meth:`Child.stop` is SIGTERM to the group, a wait, then SIGKILL to
whatever is left of the group, and the child is reaped: no zombie and no
orphan once it returns; :func:`stop_all` does the same for several children
under one deadline (`tidal up`'s agents). It lives in :mod:`rendezvous`, the
lowest package, so that :mod:`rendezvous.etcd.server` and the service's
supervisors (:mod:`service.up.prometheus`, :mod:`service.up.children`) share it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: How long :meth:`Child.stop` waits for the reaping after the group's SIGKILL.
REAP_TIMEOUT_S = 10.0


_PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (None off Linux). Loaded once, in the parent: ``find_library``
    runs ``ldconfig`` in a subprocess, which must not happen in a forked child."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that created it
    exits (Linux's ``PR_SET_PDEATHSIG``); False where it is not supported."""
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _dying_with(parent: int, sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when ``parent`` (this process) dies, and
    exits at once if it already has (it was re-parented before the call)."""
    _libc()  # loaded here, before the fork; the child only calls prctl

    def preexec() -> None:
        if set_parent_death_signal(sig) and os.getppid() != parent:
            os._exit(128 + sig)

    return preexec


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pid`` leads; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def read_tail(path: Path, lines: int = 20, *, offset: int = 0) -> str:
    """The last ``lines`` lines of ``path`` from byte ``offset`` on ("" if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Child:
    """A process in its own group, its stdout and stderr appended to ``log_path``."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], log_path: Path,
                 log_offset: int) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self.log_offset = log_offset  # where this run's output starts in the log

    @classmethod
    def spawn(
        cls,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        parent_death_signal: signal.Signals | None = None,
    ) -> Child:
        """Start ``argv`` (a list: never a shell) in a new process group.

        ``parent_death_signal``: sent to the child by the kernel when the thread
        that starts it exits (this process SIGKILLed included): its own session
        keeps it out of reach of a signal to this process's group, so without it a
        SIGKILLed parent leaves it running. Start such a child from a thread that
        lives as long as it should (the main thread).
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,  # its own process group, stopped as a whole
                preexec_fn=(None if parent_death_signal is None
                            else _dying_with(os.getpid(), int(parent_death_signal))),
            )
        return cls(name, process, log_path, offset)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()

    def running(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's whole process group."""
        signal_group(self.process.pid, sig)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines this run of the child wrote to its log."""
        return read_tail(self.log_path, lines, offset=self.log_offset)

    def wait(self, timeout_s: float) -> int | None:
        """Its exit status once it exits within ``timeout_s``, else None."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to ``timeout_s``, SIGKILL what is left, reap.

        Idempotent. Returns the child's exit status (None only if it could
        not be reaped even after SIGKILL).
        """
        return stop_all([self], timeout_s)[0]

    def kill(self) -> int | None:
        """SIGKILL the group at once (a crash, for fault tests) and reap the child."""
        self.signal(signal.SIGKILL)
        return self.wait(REAP_TIMEOUT_S)


def stop_all(children: Sequence[Child], timeout_s: float) -> list[int | None]:
    """Stop several children at once, each as :meth:`Child.stop` does: SIGTERM to
    every group whose child still runs, one wait of up to ``timeout_s`` for them
    all, then SIGKILL to whatever is left of each group, and each child reaped.

    Returns:
        Each child's exit status, in order (None where it could not be reaped).
    """
    for child in children:
        if child.poll() is None:
            child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for child in children:
        if child.wait(max(0.0, deadline - time.monotonic())) is None:
            log.warning("%s (pid %d) did not stop within %g s; killing it",
                        child.name, child.pid, timeout_s)
        child.signal(signal.SIGKILL)  # anything left in the group
        codes.append(child.wait(REAP_TIMEOUT_S))
    return codes
