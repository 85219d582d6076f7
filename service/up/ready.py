"""The ready file: how a coordinator or agent started by `tidal up` says it is ready.

``tidal coordinator --ready-file PATH`` and ``tidal agent --ready-file PATH``
write one JSON object, a :class:`ReadyFile`, once they serve: their pid, and
the coordinator's URL or the agent's metrics port (either may have been asked
for as port 0). The file is replaced through a rename, so a reader never sees
half of it; the reader checks the pid, so a file left by a previous
incarnation of the same child is never taken for the new one's. Log lines are
for people; this file is the protocol.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ReadyFile(BaseModel):
    """What a ready child says about itself.

    Attributes:
        pid: the process that wrote it.
        url: the coordinator's base URL (coordinators only).
        metrics_port: the port the agent's /metrics listens on (agents only).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(gt=0)
    url: str | None = None
    metrics_port: int | None = Field(default=None, ge=1, le=65535)


def write_atomically(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Write ``path`` through a temporary file and a rename: readers never see half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # O_CREAT's mode is masked by the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_ready(path: Path, ready: ReadyFile) -> None:
    """Replace the ready file at ``path``."""
    write_atomically(path, ready.model_dump_json(exclude_none=True) + "\n", mode=0o600)


def read_ready(path: Path, pid: int) -> ReadyFile | None:
    """The ready file at ``path`` if process ``pid`` wrote it; None otherwise (not yet,
    another process's, or unreadable)."""
    try:
        ready = ReadyFile.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
    return ready if ready.pid == pid else None
