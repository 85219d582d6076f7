"""The errors the checkpoints library raises.

Everything it raises on purpose derives from :class:`CheckpointError`, so a
training script can catch one class. Messages are sentences that name the
checkpoint, the file and the reason.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointStateError",
    "CheckpointWriteError",
]


class CheckpointError(Exception):
    """Base class of every error this library raises on purpose."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete, damaged or unsafe to load.

    Attributes:
        path: the checkpoint directory.
        file: the file at fault (``None`` when the checkpoint as a whole is).
        reason: why it was rejected, as a sentence fragment.
    """

    def __init__(self, path: Path, file: str | None, reason: str) -> None:
        self.path = path
        self.file = file
        self.reason = reason
        where = f"{path}/{file}" if file else str(path)
        super().__init__(f"checkpoint {where} is unusable: {reason}")


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions, ...); older ones are intact."""


class CheckpointStateError(CheckpointError):
    """The training state cannot be checkpointed or restored as described."""


class LiveResizeError(CheckpointError):
    """The live path cannot go on (the worker fails; the runner restarts the group)."""
