"""Processes of the GPU check: each in its own session, waited on with a deadline, always stopped.

Everything the check starts carries :data:`MARKER` (a fresh id per run) in its
environment, inherited by whatever it starts in turn (``tidal up``'s etcd,
coordinator and agents, their runners and workers, torchrun's workers), so
:meth:`Processes.stop_all` can find every process of this run, however it
was started, and SIGKILL each one's process group by id, once the groups it
started itself are gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from tests.support.processes import processes_with_env

T = TypeVar("T")

MARKER = "GPU_CHECK_RUN_ID"  # not TIDAL_*: `tidal up` strips those from its children


class Deadline:
    """A point in time on the monotonic clock; ``left()`` says what remains of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.left() <= 0.0


def wait_for(condition: Callable[[], T | None], *, deadline: Deadline | float, what: str,
             interval: float = 0.2, alive: Callable[[], str | None] | None = None,
             fatal: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``condition`` until it returns a truthy value; return that value.

    Args:
        alive: called each round; a message it returns (a process died) ends the wait.
        fatal: errors of the condition that end the wait (others are retried).

    Raises:
        TimeoutError: naming ``what`` and the last value or error seen.
        RuntimeError: ``alive`` said why waiting is pointless.
    """
    if not isinstance(deadline, Deadline):
        deadline = Deadline(deadline)
    last: object = None
    while True:
        try:
            value = condition()
            if value:
                return value
            last = value
        except fatal:
            raise
        except Exception as exc:  # the condition may fail while things start
            last = exc
        if alive is not None:
            dead = alive()
            if dead:
                raise RuntimeError(f"{dead} while waiting for {what}")
        if deadline.passed():
            raise TimeoutError(f"gave up waiting for {what} (last: {last!r})")
        time.sleep(min(interval, max(0.01, deadline.left())))


class Processes:
    """Starts processes in new sessions under this run's marker; stops them all."""

    def __init__(self, log_dir: Path) -> None:
        # A caller that must sweep up after this run (tests/gpu/test_dry_run.py) names it.
        self.run_id = os.environ.get(MARKER) or uuid.uuid4().hex
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._started: list[subprocess.Popen[bytes]] = []

    def env(self, extra: Mapping[str, str] | None = None,
            drop_prefix: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if drop_prefix is None or not k.startswith(drop_prefix)}
        env.update(extra or {})
        env[MARKER] = self.run_id
        return env

    def start(self, argv: Sequence[str], *, log_name: str, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` (never through a shell), its output in ``log_dir/log_name``."""
        with open(self.log_dir / log_name, "ab") as log:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=dict(env or self.env()),
                                    cwd=cwd, start_new_session=True)
        self._started.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, log_name: str, timeout: float,
            env: Mapping[str, str] | None = None, cwd: Path | None = None) -> int:
        """Run ``argv`` to its end; on ``timeout`` its group is killed and TimeoutError raised."""
        proc = self.start(argv, log_name=log_name, env=env, cwd=cwd)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{argv[2] if len(argv) > 2 else argv[0]} ran past its "
                               f"{timeout:.0f} s (log: {log_name})") from exc
        finally:
            self.kill(proc)

    def log_tail(self, log_name: str, lines: int = 15) -> str:
        path = self.log_dir / log_name
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL ``proc``'s process group and reap ``proc``."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    @staticmethod
    def terminate(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
        """SIGTERM ``proc`` alone (it stops its own children), wait; its exit code or None."""
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop_all(self) -> list[int]:
        """Kill what this run started, then any process still marked with its id.

        Returns:
            The pids found by the marker after the started groups were killed
            (processes that left their group, or escaped a parent's death signal).
        """
        for proc in self._started:
            self.kill(proc)
        self._started.clear()
        strays = marked_processes(self.run_id)
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return strays


def marked_processes(run_id: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``MARKER=run_id``, not this one."""
    return processes_with_env(MARKER, run_id)


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started, in Unix time, to about 10 ms.

    ``/proc/PID/stat`` gives the start in clock ticks since boot and ``/proc/uptime``
    the time since boot (to 10 ms): the difference is how long ago it started.
    """
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
