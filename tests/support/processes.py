"""Start test processes in their own process groups and always stop them.

Every process a test starts goes through :class:`ProcessGroupRegistry`, whose
``stop_all`` (called by the ``procs`` fixture at teardown, even when the test
failed) SIGKILLs each group and reaps it, so no orphan survives a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.support.wait import wait_for


class ProcessGroupRegistry:
    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        append: bool = True,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (never through a shell) in a new session, output to ``log_path``
        (appended to, or truncated and written from the start as torch does)."""
        with open(log_path, "ab" if append else "wb") as log_file:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    @staticmethod
    def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def kill_group(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the whole process group of ``proc`` and reap ``proc``."""
        self.signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self._procs:
            self.kill_group(proc)
        self._procs.clear()


def group_members(pgid: int) -> list[int]:
    """PIDs still alive in process group ``pgid`` (zombies excluded)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name, which is in parentheses.
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes (not this one, not zombies) whose environment holds ``name=value``:
    what a run marked everything it started with, to find what survived it."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def dump_stacks(logs: dict[Path, int], *, timeout: float = 5) -> set[Path]:
    """SIGUSR1 each pid in ``logs`` (log path -> pid), whose faulthandler writes every
    thread's stack into that log; wait up to ``timeout`` s for the logs to grow.

    Returns the logs whose process was signalled (a pid already gone is skipped).
    """
    asked: dict[Path, int] = {}
    for path, pid in logs.items():
        with contextlib.suppress(OSError):
            size = path.stat().st_size
            os.kill(pid, signal.SIGUSR1)
            asked[path] = size
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: all(p.stat().st_size > size for p, size in asked.items()),
                 timeout=timeout, what="the stack dumps")
    return set(asked)
