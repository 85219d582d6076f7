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

Each file is written through :func:`checkpoints.files.open_for_checkpoint`
(direct I/O, checksummed on the way).
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
from typing import Any

from checkpoints.errors import CheckpointCorruptError, CheckpointWriteError
from checkpoints.files import file_crc32, fsync_dir

__all__ = [
    "FENCE_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Candidate",
    "CheckpointStore",
    "Fence",
    "FileEntry",
    "Manifest",
    "checkpoint_name",
    "jit_name",
    "order_candidates",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tidal-checkpoint"
MANIFEST_VERSION = 1
_FINAL = re.compile(r"^step-(\d{10,})$")
_JIT = re.compile(r"^jit-(\d{10,})-e(\d{8,})-r(\d{5,})$")
FENCE_NAME = ".fence.json"


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

    @contextlib.contextmanager
    def open_verified(self, path: Path, manifest: Manifest, name: str) -> Iterator[Path]:
        """Open one file of a checkpoint, check its size and CRC-32, and yield a path to it.

        The file is checked in place, by parallel reads (:func:`file_crc32`),
        without holding it in memory; the caller then loads it from the path
        yielded (``torch.load`` by name, memory-mapped or not). On Linux that
        path names the descriptor opened here (``/proc/self/fd/N``), so what
        is loaded is the very file that was checked even if a name is
        replaced meanwhile. Checkpoint files are never written after their
        commit: the checked bytes are the loaded bytes.

        Raises:
            CheckpointCorruptError: when the file is missing, or its size or CRC-32 is wrong.
        """
        entry = manifest.files.get(name)
        if entry is None:
            raise CheckpointCorruptError(path, name, "the manifest does not list it")
        try:
            fd = os.open(path / name, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(path, name, "it is missing") from exc
        except OSError as exc:
            raise CheckpointCorruptError(path, name, f"it cannot be opened ({exc})") from exc
        try:
            pinned = Path(f"/proc/self/fd/{fd}")
            if not pinned.exists():  # no procfs (macOS): the name itself
                pinned = path / name
            _check_length(path, name, entry, os.fstat(fd).st_size)  # before reading it all
            try:
                size, crc = file_crc32(pinned)
            except OSError as exc:
                raise CheckpointCorruptError(path, name, f"it cannot be read ({exc})") from exc
            _check_content(path, name, entry, size=size, crc=crc)
            yield pinned
        finally:
            os.close(fd)

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
    _check_length(path, name, entry, size)


def _check_length(path: Path, name: str, entry: FileEntry, size: int) -> None:
    if size != entry.size:
        raise CheckpointCorruptError(
            path, name, f"it is {size} bytes but the manifest says {entry.size} (truncated?)"
        )


def _check_content(path: Path, name: str, entry: FileEntry, *, size: int, crc: int) -> None:
    _check_length(path, name, entry, size)
    if crc != entry.crc32:
        raise CheckpointCorruptError(
            path, name, f"its CRC-32 is {crc:08x} but the manifest says {entry.crc32:08x}"
        )
