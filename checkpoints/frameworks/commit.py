"""Writing a framework's checkpoint files with no collective: several survivors may write at once.

A just-in-time save runs when the group is broken, so the ranks cannot agree on
a writer. Each file goes in whole or not at all (temporary file, fsync, rename,
fsync of the directory), and the commits of one checkpoint directory are
serialized by an ``flock`` on ``<directory>/.tidal-jit.lock``, which the kernel
releases if the holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from checkpoints.files import fsync_dir

__all__ = ["LOCK_NAME", "add_file", "fsync_file", "locked", "replace_file"]

#: The lock file of a directory's commits.
LOCK_NAME = ".tidal-jit.lock"


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` whole through ``write`` (temporary file, fsync, rename over it, fsync dir)."""
    temp = path.with_name(f".{path.name}.tidal-{os.getpid()}.tmp")
    try:
        write(temp)
        fsync_file(temp)
        os.replace(temp, path)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()
    fsync_dir(path.parent)


def add_file(directory: Path, name: str, write: Callable[[Path], None]) -> None:
    """Add ``name`` to ``directory`` unless it is there (temporary file, fsync, rename)."""
    directory.mkdir(exist_ok=True)
    if (directory / name).exists():
        return
    replace_file(directory / name, write)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s commit lock (an ``flock``; released if this process dies)."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
