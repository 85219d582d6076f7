"""Keep each rank's log files under a size cap, without stopping the workers.

torch elastic opens every rank's ``stdout.log`` / ``stderr.log`` itself and
hands the descriptors to the worker, so the files cannot be swapped under it.
Instead:

* the worker shim re-opens its stdout and stderr in append mode
  (:func:`reopen_for_append`) before ``exec``, so every write lands at the
  current end of the file;
* the runner's :class:`LogCap` thread checks the files every few seconds and,
  when one passes the cap, copies it to ``NAME.1`` (replacing the previous
  one) and truncates it to zero: logrotate's ``copytruncate``. Appending
  writers simply continue at the new end. Lines written between the copy and
  the truncation are lost; that window is a few milliseconds once per cap.

At most about twice the cap is kept per file (the live file and ``.1``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 100 * 1024 * 1024


def reopen_for_append(fds: tuple[int, ...] = (1, 2)) -> None:
    """Re-open each descriptor that is a regular file with ``O_APPEND``, in place."""
    for fd in fds:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            path = os.readlink(f"/proc/self/fd/{fd}")
            new = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # not a file we can name (deleted, no /proc): leave it as it is
        os.dup2(new, fd)
        os.close(new)


def rotate_if_large(path: Path, max_bytes: int) -> bool:
    """Copy ``path`` to ``path.1`` and truncate it, if it is larger than ``max_bytes``."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        shutil.copyfile(path, path.with_name(path.name + ".1"))
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
        self._thread.start()
        return self

    def check(self) -> None:
        for path in self.root.rglob("*.log"):
            if rotate_if_large(path, self.max_bytes):
                self.rotations += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
