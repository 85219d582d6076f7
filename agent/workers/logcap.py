"""Keep each rank's log files under a size cap, without stopping the workers.

torch elastic opens every rank's ``stdout.log`` / ``stderr.log`` itself and
hands the descriptors to the worker, so the files cannot be swapped under it.
Instead:

* the worker shim sets its stdout and stderr to append mode
  (:func:`reopen_for_append`) before ``exec``, so every write lands at the
  current end of the file;
* the runner's :class:`LogCap` thread checks the files every few seconds and,
  when one passes the cap, copies it to ``NAME.1`` (replacing the previous
  one) and truncates it to zero: logrotate's ``copytruncate``. Appending
  writers simply continue at the new end. Lines written between the copy and
  the truncation are lost; that window is a few milliseconds once per cap.

At most about twice the cap is kept per file (the live file and ``.1``).

Logs are private: the log directory is 0700 (:func:`private_log_dir`) and
every log file 0600; the shim sets the mode of its own files before the
worker writes a byte, and :class:`LogCap` that of any other it finds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 100 * 1024 * 1024
#: Log files are the agent's user's alone: a job's output may hold its secrets.
LOG_MODE = 0o600


def reopen_for_append(fds: tuple[int, ...] = (1, 2)) -> None:
    """Make each descriptor that is a regular file append-only and private (0600).

    ``O_APPEND`` is set on the open file itself (``F_SETFL``): no path is
    needed, so it works for a worker that may not reach its log's directory
    (:mod:`agent.workers.user`). The mode is changed where the file is ours.
    """
    for fd in fds:
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                continue
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
            if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != LOG_MODE:
                os.fchmod(fd, LOG_MODE)
        except OSError:
            continue  # leave it as it is


def open_private_log(path: Path) -> BinaryIO:
    """Open a log file for appending, mode 0600 (also if it existed), never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, LOG_MODE)
    try:
        os.fchmod(fd, LOG_MODE)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def private_log_dir(root: Path, *, group: int | None = None) -> None:
    """Create the job's log directory, mode 0700 (0710 with ``group``, the
    worker user's, whose workers write their error files below it)."""
    root.mkdir(parents=True, exist_ok=True)
    if group is not None:
        os.chown(root, -1, group)
    os.chmod(root, 0o700 if group is None else 0o710)


def rotate_if_large(path: Path, max_bytes: int) -> bool:
    """Copy ``path`` to ``path.1`` and truncate it, if it is larger than ``max_bytes``."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        old = path.with_name(path.name + ".1")
        shutil.copyfile(path, old)
        os.chmod(old, LOG_MODE)
        with open(path, "r+b") as handle:
            handle.truncate(0)
    except OSError as exc:
        log.warning("cannot rotate %s: %s", path, exc)
        return False
    return True


class LogCap:
    """A thread that rotates the ``*.log`` files under ``root`` past ``max_bytes``.

    Args:
        root: the job's log directory (every attempt and rank below it).
        max_bytes: the cap per file.
        interval_s: how often to look.
    """

    def __init__(self, root: Path, *, max_bytes: int, interval_s: float = 2.0) -> None:
        if max_bytes < 1024:
            raise ValueError(f"max_bytes ({max_bytes}) must be at least 1024")
        self.root = root
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        self.rotations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log cap", daemon=True)

    def start(self) -> LogCap:
        """Make the log directory private (see :func:`private_log_dir`), then watch it."""
        from agent.workers.user import from_env

        user = from_env()
        private_log_dir(self.root, group=None if user is None else user.gid)
        self._thread.start()
        return self

    def check(self) -> None:
        for path in self.root.rglob("*.log"):
            with contextlib.suppress(OSError):  # torch made it with the umask's mode
                if stat.S_IMODE(path.lstat().st_mode) != LOG_MODE and not path.is_symlink():
                    os.chmod(path, LOG_MODE)
            if rotate_if_large(path, self.max_bytes):
                self.rotations += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
