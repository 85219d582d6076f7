"""Direct-I/O checkpoint files on a filesystem that refuses O_DIRECT: buffered files and one
warning. /dev/shm no longer refuses it since Linux 6.6, so as root the test mounts a ramfs of
its own (the rest of direct I/O: tests/unit/checkpoints/test_direct_io.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpoints.files import ChecksumWriter
from tests.unit.checkpoints.test_direct_io import CHUNK, payload, write


@pytest.fixture
def no_direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that refuses O_DIRECT: /dev/shm if it does, else a ramfs."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and _refuses_direct(shm):
        directory = shm / f"tidal-test-{os.getpid()}-{random.getrandbits(32):08x}"
        directory.mkdir()
        try:
            yield directory
        finally:
            for entry in directory.iterdir():
                entry.unlink()
            directory.rmdir()
        return
    if os.geteuid() != 0:
        pytest.skip("/dev/shm takes O_DIRECT (Linux >= 6.6) and mounting a ramfs needs root")
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"/dev/shm takes O_DIRECT and ramfs cannot be mounted: {mounted.stderr}")
    try:
        assert _refuses_direct(mount_point), "ramfs took O_DIRECT: the fallback is not tested"
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def _refuses_direct(directory: Path) -> bool:
    probe = directory / f".odirect-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        return exc.errno == errno.EINVAL
    finally:
        os.close(fd)
        probe.unlink()
    return False


def test_a_filesystem_without_direct_io_gets_buffered_files_and_one_warning(
    no_direct_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = payload(CHUNK + 5)
    with caplog.at_level(logging.WARNING):
        first = write(no_direct_dir / "a.pt", [data], direct=True)
        second = write(no_direct_dir / "b.pt", [data], direct=True)
    assert isinstance(first, ChecksumWriter) and isinstance(second, ChecksumWriter)
    assert (no_direct_dir / "a.pt").read_bytes() == data == (no_direct_dir / "b.pt").read_bytes()
    assert (first.size, first.crc32) == (len(data), zlib.crc32(data))
    refusals = [r for r in caplog.records if "refuses direct I/O" in r.getMessage()]
    assert len(refusals) == 1  # once per filesystem, not once per save
