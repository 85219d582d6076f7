"""Checkpoint directories on disk: layout, atomic commit, manifest, verification, keep-K.

Layout of a checkpoint root (shared by every rank of a job)::

    <root>/step-0000000040/          a complete checkpoint (final name)
        manifest.json                written last: step, world size, files, sizes, CRC-32s
        state.pt                     replicated state (torch.save), or for sharded state:
        replicated.pt, .metadata, __0_0.distcp, ...   (torch.distributed.checkpoint files)
    <root>/.tmp-step-0000000044-...  a save in progress (never loaded; removed at restore)
    <root>/.trash-...                a checkpoint being deleted (never loaded)
    <root>/.invalid-step-...         a checkpoint restore rejected, kept for inspection
    <root>/jit-0000000057-e00000003-r00001/  a just-in-time candidate (docs/checkpoints.md):
                                     step 57, saved in restore epoch 3 by rank 1
    <root>/.fence.json               the last restore's epoch and step (the fence)

A checkpoint only ever appears under a final name complete: its files are
written into a temporary directory on the same filesystem, each file is
fsynced, ``manifest.json`` is written and fsynced, the directory is fsynced,
renamed to its final name, and the root is fsynced. Deletion goes the other way
(rename out of the final name first), so a crash at any instant leaves either
the whole checkpoint or none of it under ``step-*``.

Verification re-reads every file the manifest lists and compares its size and
CRC-32: truncation, zeroed blocks and missing files are all caught, and the
reason names the file.

Files are written with direct I/O (``O_DIRECT``) where the filesystem allows
it: writing hundreds of MB through the page cache costs the writing thread
most of a second of kernel CPU per save on a VM where fresh memory is
expensive to touch, CPU that comes out of training on a machine with few
cores; direct writes from one small reused buffer cost a few hundredths of
that (see :class:`DirectWriter`, and docs/benchmarks.md for the figures).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from checkpoints.errors import CheckpointCorruptError, CheckpointWriteError

__all__ = [
    "FENCE_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "STAGING_BYTES",
    "Candidate",
    "CheckpointFileWriter",
    "CheckpointStore",
    "ChecksumWriter",
    "DirectWriter",
    "Fence",
    "FileEntry",
    "Manifest",
    "checkpoint_name",
    "file_crc32",
    "fsync_dir",
    "jit_name",
    "open_for_checkpoint",
    "order_candidates",
    "use_direct_io",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tidal-checkpoint"
MANIFEST_VERSION = 1
_FINAL = re.compile(r"^step-(\d{10,})$")
_JIT = re.compile(r"^jit-(\d{10,})-e(\d{8,})-r(\d{5,})$")
FENCE_NAME = ".fence.json"
_CHUNK = 8 << 20
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


def checkpoint_name(step: int) -> str:
    """The final directory name of the checkpoint taken after ``step`` completed steps."""
    if step < 0:
        raise ValueError(f"step ({step}) must not be negative")
    return f"step-{step:010d}"


def jit_name(step: int, *, epoch: int, rank: int) -> str:
    """The directory name of a just-in-time candidate of ``step`` by ``rank`` in ``epoch``."""
    if step < 0 or epoch < 0 or rank < 0:
        raise ValueError(f"step ({step}), epoch ({epoch}) and rank ({rank}) must not be negative")
    return f"jit-{step:010d}-e{epoch:08d}-r{rank:05d}"


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path) -> tuple[int, int]:
    """Return ``(size, crc32)`` of a file, read in chunks."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


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


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """Size and CRC-32 of one file of a checkpoint."""

    size: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` records about a checkpoint (see docs/checkpoints.md)."""

    step: int
    world_size: int
    kind: str  # "replicated" or "sharded"
    created: float  # Unix time of the commit
    files: dict[str, FileEntry]
    save_seconds: float = 0.0
    torch_version: str = ""
    #: The restore epoch of the run that saved it (0: saved before epochs existed).
    epoch: int = 0

    def to_json(self) -> str:
        """Serialize, with checksums as 8-digit hex."""
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "kind": self.kind,
            "created": self.created,
            "save_seconds": round(self.save_seconds, 6),
            "torch_version": self.torch_version,
            "epoch": self.epoch,
            "checksum": "crc32",
            "files": {
                name: {"size": e.size, "crc32": f"{e.crc32:08x}"}
                for name, e in sorted(self.files.items())
            },
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, *, path: Path) -> Manifest:
        """Parse and validate a manifest.

        Raises:
            CheckpointCorruptError: naming ``manifest.json`` and what is wrong with it.
        """

        def bad(reason: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(path, MANIFEST_NAME, reason)

        try:
            body = json.loads(text)
        except ValueError as exc:
            raise bad(f"it is not valid JSON ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
            raise bad(f"its format is not {MANIFEST_FORMAT!r}")
        if body.get("version") != MANIFEST_VERSION:
            raise bad(f"its version ({body.get('version')!r}) is not {MANIFEST_VERSION}")
        try:
            files = {
                str(name): FileEntry(size=int(e["size"]), crc32=int(str(e["crc32"]), 16))
                for name, e in dict(body["files"]).items()
            }
            manifest = cls(
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                kind=str(body["kind"]),
                created=float(body["created"]),
                files=files,
                save_seconds=float(body.get("save_seconds", 0.0)),
                torch_version=str(body.get("torch_version", "")),
                epoch=int(body.get("epoch", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"a field is missing or malformed ({exc!r})") from exc
        for name in files:
            if "/" in name or name in ("", ".", "..", MANIFEST_NAME):
                raise bad(f"it lists an invalid file name {name!r}")
        if manifest.kind not in ("replicated", "sharded"):
            raise bad(f"its kind ({manifest.kind!r}) is neither 'replicated' nor 'sharded'")
        return manifest


@dataclasses.dataclass(frozen=True)
class Fence:
    """The last restore of a checkpoint root: its epoch and the step it resumed from.

    Every restore takes the next epoch and records the step it chose (-1:
    fresh). A save made in an older epoch than the fence's, of a step after the
    fence's step, was made by a process the job had already gone on without (a
    partitioned or hung node, an old rank 0's late asynchronous save): it is
    refused at commit and ignored at restore. Saves of the fence's step or
    older are what the job's lineage passed through, and stay usable.
    """

    epoch: int = 0
    step: int = -1

    def fences_out(self, *, step: int, epoch: int) -> bool:
        """Whether a save of ``step`` made in ``epoch`` is stale under this fence."""
        return epoch < self.epoch and step > self.step


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A checkpoint restore may choose: a periodic one (``step-*``) or a just-in-time one.

    ``epoch`` and ``rank`` come from a just-in-time candidate's name; a periodic
    checkpoint's epoch is in its manifest (read when it is verified).
    """

    step: int
    path: Path
    jit: bool
    epoch: int = 0
    rank: int = 0


def order_candidates(candidates: list[Candidate]) -> list[Candidate]:
    """Newest step first; at one step a periodic checkpoint, then the newest epoch's, lowest rank.

    Every candidate of one step holds the same state (a replicated job's ranks
    are identical after each optimizer step), so which one wins a tie only
    decides how much is renamed.
    """
    return sorted(candidates, key=lambda c: (-c.step, c.jit, -c.epoch, c.rank))


class CheckpointStore:
    """The checkpoints under one root directory.

    Args:
        root: the directory; created if missing.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path_of(self, step: int) -> Path:
        """The final path of the checkpoint of ``step``."""
        return self.root / checkpoint_name(step)

    def steps(self) -> list[int]:
        """Steps of the checkpoints under final names, newest first (not verified)."""
        found = []
        for entry in os.scandir(self.root):
            match = _FINAL.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def candidates(self) -> list[Candidate]:
        """Periodic and just-in-time checkpoints under final names, newest first (not verified)."""
        found = [Candidate(step=s, path=self.path_of(s), jit=False) for s in self.steps()]
        for entry in os.scandir(self.root):
            match = _JIT.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append(Candidate(
                    step=int(match.group(1)), path=Path(entry.path), jit=True,
                    epoch=int(match.group(2)), rank=int(match.group(3)),
                ))
        return order_candidates(found)

    def read_fence(self) -> Fence:
        """The last restore's fence; ``Fence()`` (fences nothing) if there is none or it is bad."""
        try:
            body = json.loads((self.root / FENCE_NAME).read_text(encoding="utf-8"))
            return Fence(epoch=int(body["epoch"]), step=int(body["step"]))
        except FileNotFoundError:
            return Fence()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", self.root / FENCE_NAME, exc)
            return Fence()

    def write_fence(self, fence: Fence) -> None:
        """Replace the fence durably (a temporary file renamed over it).

        Raises:
            CheckpointWriteError: when it cannot be written.
        """
        temp = self.root / f".tmp-fence-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(json.dumps({"epoch": fence.epoch, "step": fence.step}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.rename(temp, self.root / FENCE_NAME)
            fsync_dir(self.root)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise CheckpointWriteError(f"writing {self.root / FENCE_NAME} failed: {exc}") from exc

    def promote(self, candidate: Candidate) -> Path:
        """Give a just-in-time candidate its step's final name (kept if one already has it).

        Raises:
            CheckpointWriteError: when the rename fails.
        """
        final = self.path_of(candidate.step)
        if not candidate.jit or candidate.path == final:
            return final
        try:
            if final.exists():
                self._remove(candidate.path)
            else:
                os.rename(candidate.path, final)
                fsync_dir(self.root)
        except OSError as exc:
            raise CheckpointWriteError(
                f"promoting {candidate.path} to {final} failed: {exc}"
            ) from exc
        return final

    def remove_candidate(self, candidate: Candidate) -> None:
        """Delete a just-in-time candidate that is no longer needed (best effort)."""
        with contextlib.suppress(OSError):
            self._remove(candidate.path)

    def new_temp_dir(self, step: int, *, token: str | None = None) -> Path:
        """Create (or, with a fixed ``token`` shared by all ranks, reuse) a temporary directory."""
        token = token if token is not None else f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = self.root / f".tmp-{checkpoint_name(step)}-{token}"
        path.mkdir(exist_ok=token is not None)
        return path

    def commit(self, temp_dir: Path, manifest: Manifest, *, name: str | None = None) -> Path:
        """Write the manifest into ``temp_dir`` and move it to its final name, durably.

        ``name`` (a just-in-time candidate's) replaces the step's final name.
        An existing checkpoint of the same name is replaced (moved out first).
        A save the fence rules out (:class:`Fence`) is refused, and removed.

        Raises:
            CheckpointWriteError: when a write, fsync or rename fails, or the
                save is fenced out.
        """
        final = self.root / name if name is not None else self.path_of(manifest.step)
        fence = self.read_fence()
        if fence.fences_out(step=manifest.step, epoch=manifest.epoch):
            self.discard(temp_dir)
            raise CheckpointWriteError(
                f"not committing the checkpoint of step {manifest.step} (epoch "
                f"{manifest.epoch}): the job restored step {fence.step} in epoch "
                f"{fence.epoch} since; this process was fenced out"
            )
        try:
            with open(temp_dir / MANIFEST_NAME, "w", encoding="utf-8") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(temp_dir)
            if final.exists():
                self._remove(final)
            os.rename(temp_dir, final)
            fsync_dir(self.root)
        except OSError as exc:
            raise CheckpointWriteError(
                f"committing checkpoint of step {manifest.step} to {final} failed: {exc}"
            ) from exc
        return final

    def discard(self, temp_dir: Path) -> None:
        """Remove a temporary directory of a failed save (best effort)."""
        shutil.rmtree(temp_dir, ignore_errors=True)

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` checkpoints; return the deleted steps."""
        doomed = self.steps()[keep:]
        for step in doomed:
            self._remove(self.path_of(step))
        return doomed

    def quarantine(self, step: int, *, path: Path | None = None) -> Path | None:
        """Move a rejected checkpoint (``path``, default the step's) aside, for inspection."""
        source = path if path is not None else self.path_of(step)
        target = self.root / f".invalid-{source.name}-{int(time.time())}"
        try:
            os.rename(source, target)
            fsync_dir(self.root)
        except OSError as exc:
            log.warning("could not move rejected checkpoint %s aside: %s", source, exc)
            return None
        return target

    def remove_stale(self) -> list[str]:
        """Delete temporary and half-deleted directories left by crashed processes.

        Only call it when no save of this job can be in progress (at restore).
        """
        removed = []
        for entry in os.scandir(self.root):
            if entry.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        return removed

    def _remove(self, path: Path) -> None:
        # Out of the final name first: a crash mid-delete leaves only a .trash- entry.
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def read_manifest(self, path: Path) -> Manifest:
        """Read and validate the manifest of the checkpoint at ``path``.

        Raises:
            CheckpointCorruptError: when it is missing or invalid, or disagrees with the path.
        """
        try:
            text = (path / MANIFEST_NAME).read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(path, MANIFEST_NAME, "it is missing") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(path, MANIFEST_NAME, f"it cannot be read ({exc})") from exc
        manifest = Manifest.from_json(text, path=path)
        jit = _JIT.match(path.name)
        expected = int(jit.group(1)) if jit else None
        if checkpoint_name(manifest.step) != path.name and manifest.step != expected:
            raise CheckpointCorruptError(
                path, MANIFEST_NAME, f"it records step {manifest.step}, not the directory's step"
            )
        return manifest

    def verify(self, path: Path, *, checksums: bool = True) -> Manifest:
        """Check that every file the manifest lists exists with its size (and CRC-32).

        Returns:
            The manifest.

        Raises:
            CheckpointCorruptError: naming the first file at fault and why.
        """
        manifest = self.read_manifest(path)
        for name, entry in manifest.files.items():
            _check_size(path, name, entry)
        if checksums:
            for name, entry in manifest.files.items():
                size, crc = file_crc32(path / name)
                _check_content(path, name, entry, size=size, crc=crc)
        return manifest

    def read_verified(self, path: Path, manifest: Manifest, name: str) -> bytes:
        """Read one file of a checkpoint whole, checking it against the manifest on the way.

        Raises:
            CheckpointCorruptError: when the file is missing, or its size or CRC-32 is wrong.
        """
        entry = manifest.files.get(name)
        if entry is None:
            raise CheckpointCorruptError(path, name, "the manifest does not list it")
        _check_size(path, name, entry)
        data = (path / name).read_bytes()
        _check_content(path, name, entry, size=len(data), crc=zlib.crc32(data))
        return data


def _check_size(path: Path, name: str, entry: FileEntry) -> None:
    try:
        size = (path / name).stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(path, name, "it is missing") from exc
    if size != entry.size:
        raise CheckpointCorruptError(
            path, name, f"it is {size} bytes but the manifest says {entry.size} (truncated?)"
        )


def _check_content(path: Path, name: str, entry: FileEntry, *, size: int, crc: int) -> None:
    if size != entry.size:
        raise CheckpointCorruptError(
            path, name, f"it is {size} bytes but the manifest says {entry.size} (truncated?)"
        )
    if crc != entry.crc32:
        raise CheckpointCorruptError(
            path, name, f"its CRC-32 is {crc:08x} but the manifest says {entry.crc32:08x}"
        )


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
