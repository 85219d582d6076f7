"""Writing one checkpoint file: checksummed on the way, fsynced, with direct I/O.

Files are written with direct I/O (``O_DIRECT``) where the filesystem allows
it: writing hundreds of MB through the page cache costs the writing thread
most of a second of kernel CPU per save on a VM where fresh memory is
expensive to touch, CPU that comes out of training on a machine with few
cores; direct writes from one small reused buffer cost a few hundredths of
that (see :class:`DirectWriter`, and docs/benchmarks.md for the figures).
:func:`open_for_checkpoint` picks the writer; :mod:`checkpoints.storage` lays
the files out and commits them.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import contextvars
import errno
import fcntl
import logging
import mmap
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "STAGING_BYTES",
    "CheckpointFileWriter",
    "ChecksumWriter",
    "DirectWriter",
    "crc32_combine",
    "file_crc32",
    "fsync_dir",
    "open_for_checkpoint",
    "use_direct_io",
]

log = logging.getLogger("checkpoints.storage")

_CHUNK = 8 << 20
#: At most this many threads read one file to check it, each at least this many bytes.
_MAX_READERS = 8
_MIN_REGION = 64 << 20
#: Bytes of each direct write (a multiple of any block size O_DIRECT asks for).
STAGING_BYTES = 8 << 20
#: Offsets and lengths of direct writes are multiples of this (the page size,
#: which no common device's logical block size exceeds).
_ALIGN = mmap.PAGESIZE
#: 0 where the platform has no direct I/O (macOS): files are then always buffered.
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
#: Whether open_for_checkpoint writes with direct I/O, in this thread or task.
_DIRECT_IO: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tidal_checkpoint_direct_io", default=True
)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path, *, threads: int | None = None) -> tuple[int, int]:
    """Return ``(size, crc32)`` of a file, read by several threads at once.

    The file is cut into one contiguous region per thread; each thread reads
    its region through a descriptor of its own (so that the kernel's
    readahead sees one sequential stream per thread, made larger by
    ``POSIX_FADV_SEQUENTIAL``) into a small reused buffer, and the regions'
    CRCs are joined with :func:`crc32_combine`. ``zlib.crc32`` releases the
    GIL, so a 2.4 GB file is checked at the speed of the disk or of all the
    cores rather than of one core (docs/benchmarks.md, "Restore of a large
    checkpoint"). Reading into a fresh buffer the size of the file instead
    costs the page faults of that buffer, which were most of the old pass.

    Args:
        path: the file.
        threads: how many readers (default: the usable cores, at most 8, and
            one per 64 MiB of file).
    """
    size = os.stat(path).st_size
    if threads is None:
        threads = min(_usable_cores(), _MAX_READERS)
    regions = max(1, min(threads, size // _MIN_REGION))
    step = max(1, -(-size // regions))
    bounds = [(start, min(size, start + step)) for start in range(0, size, step)] or [(0, 0)]
    if len(bounds) == 1:
        crcs = [_region_crc32(path, *bounds[0])]
    else:
        with concurrent.futures.ThreadPoolExecutor(len(bounds), "tidal-crc32") as pool:
            crcs = list(pool.map(lambda b: _region_crc32(path, *b), bounds))
    crc = crcs[0]
    for (start, end), part in zip(bounds[1:], crcs[1:], strict=True):
        crc = crc32_combine(crc, part, end - start)
    return size, crc


def _region_crc32(path: Path, start: int, end: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError, AttributeError):  # a hint; macOS has no fadvise
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
        buffer = memoryview(bytearray(min(_CHUNK, max(end - start, 1))))
        crc, offset = 0, start
        while offset < end:
            read = os.preadv(fd, [buffer[: min(len(buffer), end - offset)]], offset)
            if read == 0:  # shorter than at the stat: the CRC (and size) will not match
                break
            crc = zlib.crc32(buffer[:read], crc)
            offset += read
        return crc
    finally:
        os.close(fd)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (bit-reflected, as zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's algorithm).

    Python's zlib does not export ``crc32_combine``; this is its arithmetic,
    about 40 small multiplications, so joining a few regions costs microseconds.
    """
    p, n, k = 1 << 31, len2, 3  # x^(8 * len2) mod P, from x^(2^k) for each set bit
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ (crc2 & 0xFFFFFFFF)


class CheckpointFileWriter(abc.ABC):
    """A write-only file object for ``torch.save`` that checksums what passes through.

    The contract: :meth:`write` takes bytes or a memoryview, folds it into
    ``crc32`` and ``size`` and returns its length; the caller may reuse the
    memory as soon as it returns. :meth:`flush` may be called at any time and
    promises nothing about the disk. Only :meth:`finish`, called once after the
    last write, makes the file complete and durable (fsynced). ``crc32`` and
    ``size`` describe exactly the bytes of the file, whichever way they went to
    disk. Writers are made by :func:`open_for_checkpoint`.
    """

    def __init__(self) -> None:
        self.crc32 = 0
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        """Write ``data`` and fold it into the checksum.

        Raises:
            OSError: when the file cannot be written (disk full, ...).
        """
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += len(view)
        self._write(view)
        return len(view)

    @abc.abstractmethod
    def flush(self) -> None:
        """Pass on what is buffered, as far as the writer can (``torch.save`` calls it)."""

    @abc.abstractmethod
    def _write(self, view: memoryview) -> None:
        """Write the bytes of ``view`` (a flat byte view) after everything written so far."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Write whatever is still pending, then fsync the file.

        Raises:
            OSError: when a write or the fsync fails.
        """


class ChecksumWriter(CheckpointFileWriter):
    """Writes through the page cache (a buffered file object).

    ``torch.save`` writes each tensor storage with one ``write`` of a
    memoryview, so hashing here costs one pass over the data and no copy.
    """

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self._file = file

    def _write(self, view: memoryview) -> None:
        self._file.write(view)

    def flush(self) -> None:
        """Flush the file object into the page cache."""
        self._file.flush()

    def finish(self) -> None:
        """Flush the file object, then fsync."""
        self._file.flush()
        os.fsync(self._file.fileno())


class DirectWriter(CheckpointFileWriter):
    """Writes with ``O_DIRECT`` from an aligned staging buffer, bypassing the page cache.

    Direct I/O needs the memory address, the length and the file offset of
    each write to be multiples of the device's block size, which the data
    ``torch.save`` hands over never are. So every write is copied into
    ``staging`` (page-aligned, reused from file to file; memcpy costs a few ms
    per hundred MB, the page cache costs about a second of kernel CPU), and
    each time it fills up it goes to disk in one direct write. The last,
    partial block cannot be written directly: :meth:`finish` writes the
    aligned part directly, clears ``O_DIRECT`` and writes the rest through the
    page cache, then fsyncs (direct writes skip the page cache, not the
    device's cache nor the file's metadata).

    If the filesystem refuses a direct write (``EINVAL``: a larger block size,
    a filesystem with its own rules), the writer clears ``O_DIRECT`` and goes on
    through the page cache; nothing is lost, and the file is the same.

    Args:
        fd: a file descriptor open for writing at offset 0, with ``O_DIRECT`` set.
        staging: a writable buffer; its length is the size of each direct write
            and a multiple of the block size, and its address is aligned.
        path: the file's path, for log lines.

    Attributes:
        direct: whether ``O_DIRECT`` is still on (False after a fallback or the tail).
    """

    def __init__(self, fd: int, staging: memoryview, *, path: Path) -> None:
        super().__init__()
        self._fd = fd
        self._staging = staging
        self._path = path
        self._filled = 0
        self.direct = True

    def _write(self, view: memoryview) -> None:
        capacity = len(self._staging)
        offset = 0
        while offset < len(view):
            # In pieces: a 300 MB storage never becomes one 300 MB bytes object.
            take = min(len(view) - offset, capacity - self._filled)
            self._staging[self._filled : self._filled + take] = view[offset : offset + take]
            self._filled += take
            offset += take
            if self._filled == capacity:
                self._write_out(self._staging)
                self._filled = 0

    def flush(self) -> None:
        """Nothing: staged bytes short of a whole buffer cannot be written directly yet."""

    def finish(self) -> None:
        """Write the staged rest (aligned part direct, the tail buffered), then fsync."""
        aligned = self._filled - self._filled % _ALIGN
        if aligned and self.direct:
            self._write_out(self._staging[:aligned])
        else:
            aligned = 0
        if self._filled > aligned:
            self._clear_direct(None)  # the tail is not a whole block
            self._write_out(self._staging[aligned : self._filled])
        self._filled = 0
        os.fsync(self._fd)

    def _write_out(self, view: memoryview) -> None:
        while view:
            try:
                written = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._clear_direct(f"a direct write was refused ({exc})")
                continue
            view = view[written:]

    def _clear_direct(self, reason: str | None) -> None:
        """Go on through the page cache; ``reason`` (a fallback, not the tail) is logged."""
        if not self.direct:
            return
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False
        if reason is not None:
            log.warning("writing %s through the page cache: %s", self._path, reason)


class _StagingPool:
    """Page-aligned staging buffers for direct writes, kept from one file to the next.

    A fresh buffer is page-faulted in by its first use; keeping it makes every
    later save copy into memory that is already mapped. One buffer serves the
    usual one save at a time; a concurrent writer gets a buffer of its own,
    and at most ``keep`` buffers are kept.
    """

    def __init__(self, size: int, *, keep: int = 2) -> None:
        self._size, self._keep = size, keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[memoryview]:
        """A buffer for the duration of the block."""
        with self._lock:
            # Anonymous mmap: page-aligned. Private: a forked child gets its own copy.
            buffer = self._free.pop() if self._free else mmap.mmap(-1, self._size, mmap.MAP_PRIVATE)
        try:
            with memoryview(buffer) as view:
                yield view
        finally:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buffer)
            # A buffer not kept is unmapped when the last view of it is gone; closing
            # it here could fail while a traceback still holds a slice of it.


_STAGING = _StagingPool(STAGING_BYTES)
#: Devices (st_dev) whose filesystem refused O_DIRECT: said once per process, not per save.
_NO_DIRECT_IO: set[int] = set()


@contextlib.contextmanager
def use_direct_io(enabled: bool) -> Iterator[None]:
    """Within the block, :func:`open_for_checkpoint` writes directly (True, the default) or not.

    A context variable, so it applies to the thread (or asyncio task) that
    enters the block only: a checkpointer's writer thread sets it for its own
    saves without touching any other.
    """
    token = _DIRECT_IO.set(enabled)
    try:
        yield
    finally:
        _DIRECT_IO.reset(token)


@contextlib.contextmanager
def open_for_checkpoint(path: Path) -> Iterator[CheckpointFileWriter]:
    """Create ``path``, yield a checksumming writer, then write the rest and fsync the file.

    With direct I/O on (see :func:`use_direct_io`) and a filesystem that supports
    it, the writer is a :class:`DirectWriter`; otherwise, or when the
    filesystem refuses ``O_DIRECT`` (tmpfs before Linux 6.6, ramfs, some FUSE
    and network filesystems), a :class:`ChecksumWriter`, with one warning per
    filesystem. The file is created without ``O_DIRECT`` and switched to it
    with ``fcntl``: an ``open`` with ``O_DIRECT`` that the filesystem refuses
    has already created the file.

    Raises:
        OSError: when the file exists, or cannot be created or written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if not (_DIRECT_IO.get() and _set_direct(fd, path)):
            with os.fdopen(fd, "wb", closefd=False) as f:
                buffered = ChecksumWriter(f)
                yield buffered
                buffered.finish()
            return
        with _STAGING.borrow() as staging:
            direct = DirectWriter(fd, staging, path=path)
            yield direct
            direct.finish()
    finally:
        os.close(fd)


def _set_direct(fd: int, path: Path) -> bool:
    """Turn on O_DIRECT for ``fd``; False (said once per filesystem) where it is refused."""
    if not _O_DIRECT:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        device = os.fstat(fd).st_dev
        if device not in _NO_DIRECT_IO:
            _NO_DIRECT_IO.add(device)
            log.warning(
                "the filesystem of %s refuses direct I/O (%s): checkpoints are written "
                "through the page cache there",
                path.parent,
                exc,
            )
        return False
    return True
