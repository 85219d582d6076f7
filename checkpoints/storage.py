"""Checkpoint directories on disk: layout, atomic commit, manifest, verification, keep-K.

Layout of a checkpoint root (shared by every rank of a job)::

    <root>/step-0000000040/          a complete checkpoint (final name)
        manifest.json                written last: step, world size, files, sizes, CRC-32s
        state.pt                     replicated state (torch.save), or for sharded state:
        replicated.pt, .metadata, __0_0.distcp, ...   (torch.distributed.checkpoint files)
    <root>/.tmp-step-0000000044-...  a save in progress (never loaded; removed at restore)
    <root>/.trash-...                a checkpoint being deleted (never loaded)
    <root>/.invalid-step-...         a checkpoint restore rejected, kept for inspection

A checkpoint only ever appears under a final name complete: its files are
written into a temporary directory on the same filesystem, each file is
fsynced, ``manifest.json`` is written and fsynced, the directory is fsynced,
renamed to its final name, and the root is fsynced. Deletion goes the other way
(rename out of the final name first), so a crash at any instant leaves either
the whole checkpoint or none of it under ``step-*``.

Verification re-reads every file the manifest lists and compares its size and
CRC-32: truncation, zeroed blocks and missing files are all caught, and the
reason names the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from checkpoints.errors import CheckpointCorruptError, CheckpointWriteError

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "CheckpointStore",
    "ChecksumWriter",
    "FileEntry",
    "Manifest",
    "checkpoint_name",
    "file_crc32",
    "fsync_dir",
    "open_for_checkpoint",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tidal-checkpoint"
MANIFEST_VERSION = 1
_FINAL = re.compile(r"^step-(\d{10,})$")
_CHUNK = 8 << 20


def checkpoint_name(step: int) -> str:
    """The final directory name of the checkpoint taken after ``step`` completed steps."""
    if step < 0:
        raise ValueError(f"step ({step}) must not be negative")
    return f"step-{step:010d}"


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


class ChecksumWriter:
    """A write-only file object that computes the CRC-32 and size of what passes through.

    ``torch.save`` writes each tensor storage with one ``write`` of a memoryview,
    so hashing here costs one pass over the data and no copy.
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.crc32 = 0
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        """Write ``data`` and fold it into the checksum."""
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        """Flush the underlying file."""
        self._file.flush()


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
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"a field is missing or malformed ({exc!r})") from exc
        for name in files:
            if "/" in name or name in ("", ".", "..", MANIFEST_NAME):
                raise bad(f"it lists an invalid file name {name!r}")
        if manifest.kind not in ("replicated", "sharded"):
            raise bad(f"its kind ({manifest.kind!r}) is neither 'replicated' nor 'sharded'")
        return manifest


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

    def new_temp_dir(self, step: int, *, token: str | None = None) -> Path:
        """Create (or, with a fixed ``token`` shared by all ranks, reuse) a temporary directory."""
        token = token if token is not None else f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = self.root / f".tmp-{checkpoint_name(step)}-{token}"
        path.mkdir(exist_ok=token is not None)
        return path

    def commit(self, temp_dir: Path, manifest: Manifest) -> Path:
        """Write the manifest into ``temp_dir`` and move it to its final name, durably.

        An existing checkpoint of the same step is replaced (moved out first).

        Raises:
            CheckpointWriteError: when a write, fsync or rename fails.
        """
        final = self.path_of(manifest.step)
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

    def quarantine(self, step: int) -> Path | None:
        """Move a rejected checkpoint out of the final names, keeping it for inspection."""
        source = self.path_of(step)
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
        if checkpoint_name(manifest.step) != path.name:
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
def open_for_checkpoint(path: Path) -> Iterator[ChecksumWriter]:
    """Create ``path``, yield a checksumming writer, then flush and fsync the file."""
    with open(path, "xb") as f:
        writer = ChecksumWriter(f)
        yield writer
        f.flush()
        os.fsync(f.fileno())
