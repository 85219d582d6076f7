"""The live resize's files: the contract between a node's runner and its workers.

The runner (:mod:`agent.runner.elastic`, :mod:`agent.runner.live_decide`) and the workers
(:mod:`checkpoints.live`) meet only through these files in the worker's
progress directory (``TIDAL_PROGRESS_DIR``); their names and formats have
this one home, which imports nothing but the standard library, so that a
process without torch can read and write them. What the workers do with them
is told in :mod:`checkpoints.live`; what the runner decides from them, in
:mod:`agent.runner.live_decide`.

Every file is JSON, written to a temporary file and renamed; a reader treats
a missing or malformed file as absent and never follows a symlink (the
workers run the user's code):

* ``live-resize.json``, from the runner of a node that stays, once its next
  round formed: the round number, the new master address and port, the new
  world size and this node's local-to-global rank map
  (:class:`ResizeNotice`). A newer round overwrites it.
* ``live-lost.json``, from the runner of a node that stays, as soon as it learns
  that a member is lost (an unplanned failure) and before it forms the next
  round (:class:`LostNotice`): the round that broke. The workers' watchdog
  gets them out of a collective blocked on the dead peer; they discard the
  step in flight and wait for the resize notice of a later round, which then
  says ``"lost": true`` (the old group is broken: the ranks cannot agree on a
  boundary through it; each goes on from the last step it completed).
* ``live-leave.json``, from the runner of a node that leaves (a planned stop):
  its workers train on until the group agrees to resize, then exit with
  :data:`EXIT_LEFT` (77) without saving: the others hold the state.
* ``live-<local_rank>.json``, from each worker (:class:`WorkerLive`): "ready"
  once its checkpointer can take the live path (the runner's test of
  capability), "resizing" when it acts on a planned resize, "broken" when a
  collective of its group failed (a member is lost: it waits for the notice
  marked ``lost``), "resized" with the round and step when the new group
  trains, "left" right before exiting 77.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "EXIT_LEFT",
    "LEAVE_NOTICE",
    "LOST_NOTICE",
    "RESIZE_NOTICE",
    "LeaveNotice",
    "LiveState",
    "LostNotice",
    "ResizeNotice",
    "WorkerLive",
    "clear_live_files",
    "read_leave_notice",
    "read_lost_notice",
    "read_resize_notice",
    "read_small",
    "read_worker_live",
    "worker_live_path",
    "write_leave_notice",
    "write_lost_notice",
    "write_resize_notice",
    "write_worker_live",
]

log = logging.getLogger("checkpoints.live")  # the name it always logged under

#: Exit code of a worker whose node left the job on the live path (nothing saved: the
#: others hold the state).
EXIT_LEFT = 77
#: The runner's notice to a staying node's workers: the next round's membership.
RESIZE_NOTICE = "live-resize.json"
#: The runner's notice to a leaving node's workers.
LEAVE_NOTICE = "live-leave.json"
#: The runner's notice to a staying node's workers that a member is lost (unplanned).
LOST_NOTICE = "live-lost.json"
_WORKER_PREFIX = "live-"


class LiveState(enum.StrEnum):
    """A worker's state on the live path: READY -> RESIZING -> RESIZED (-> RESIZING ...),
    READY/RESIZED -> BROKEN -> RESIZED (a member lost: in place), or READY/RESIZED ->
    LEFT (terminal)."""

    READY = "ready"
    RESIZING = "resizing"
    BROKEN = "broken"
    RESIZED = "resized"
    LEFT = "left"

    def is_terminal(self) -> bool:
        return self is LiveState.LEFT


@dataclasses.dataclass(frozen=True)
class ResizeNotice:
    """``live-resize.json``: the new round, as this node's runner formed it.

    ``group_rank`` and ``group_world_size`` (the node's rank and the number of
    nodes) are optional: when present, workers export them as GROUP_RANK and
    GROUP_WORLD_SIZE. ``lost``: the round replaces one that a lost member broke
    (in-place recovery: the workers re-form without agreeing through the old group).
    """

    round: int
    master_addr: str
    master_port: int
    world_size: int
    ranks: Mapping[int, int]  # local rank -> global rank
    written_at: float
    group_rank: int | None = None
    group_world_size: int | None = None
    lost: bool = False

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "round": self.round,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "ranks": {str(local): rank for local, rank in sorted(self.ranks.items())},
            "written_at": self.written_at,
        }
        if self.group_rank is not None:
            body["group_rank"] = self.group_rank
        if self.group_world_size is not None:
            body["group_world_size"] = self.group_world_size
        if self.lost:
            body["lost"] = True
        return body

    @classmethod
    def from_json(cls, body: Any) -> ResizeNotice:
        """Parse and check a notice.

        Raises:
            ValueError: naming what is wrong with it.
        """
        if not isinstance(body, dict):
            raise ValueError("a resize notice must be a JSON object")
        world_size = _int(body, "world_size", minimum=1)
        ranks_in = body.get("ranks")
        if not isinstance(ranks_in, dict) or not ranks_in:
            raise ValueError("ranks must be a non-empty object")
        ranks: dict[int, int] = {}
        for local, rank in ranks_in.items():
            if not (isinstance(local, str) and local.isdigit()):
                raise ValueError(f"local rank {local!r} is not a number")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ValueError(f"rank {rank!r} is not within world size {world_size}")
            ranks[int(local)] = rank
        addr = body.get("master_addr")
        if not isinstance(addr, str) or not addr or len(addr) > 255:
            raise ValueError(f"master_addr {addr!r} is not a host name")
        port = _int(body, "master_port", minimum=1)
        if port > 65535:
            raise ValueError(f"master_port ({port}) is not a port")
        written = body.get("written_at", 0.0)
        if isinstance(written, bool) or not isinstance(written, int | float):
            raise ValueError(f"written_at ({written!r}) is not a time")
        lost = body.get("lost", False)
        if not isinstance(lost, bool):
            raise ValueError(f"lost ({lost!r}) is not a boolean")
        return cls(
            round=_int(body, "round", minimum=1),
            master_addr=addr,
            master_port=port,
            world_size=world_size,
            ranks=ranks,
            written_at=float(written),
            group_rank=_int(body, "group_rank", minimum=0) if "group_rank" in body else None,
            group_world_size=(
                _int(body, "group_world_size", minimum=1) if "group_world_size" in body else None
            ),
            lost=lost,
        )


@dataclasses.dataclass(frozen=True)
class LeaveNotice:
    """``live-leave.json``: this node leaves the job (a planned stop)."""

    written_at: float


@dataclasses.dataclass(frozen=True)
class LostNotice:
    """``live-lost.json``: a member of round ``round`` is lost; its group is broken."""

    round: int
    written_at: float


@dataclasses.dataclass(frozen=True)
class WorkerLive:
    """``live-<local_rank>.json``: a worker's live-path state, for its runner."""

    pid: int
    round: int
    step: int | None
    state: LiveState

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "round": self.round, "step": self.step, "state": str(self.state)}

    @classmethod
    def from_json(cls, body: Any) -> WorkerLive:
        """Raises: ValueError naming what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("a worker's live file must be a JSON object")
        step = body.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"step ({step!r}) is not an integer")
        return cls(
            pid=_int(body, "pid", minimum=1),
            round=_int(body, "round", minimum=0),
            step=step,
            state=LiveState(str(body.get("state"))),
        )


def _int(body: Mapping[str, Any], name: str, *, minimum: int) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} ({value!r}) must be an integer of at least {minimum}")
    return value


# ------------------------------------------------------------------- the files


def _write_json(path: Path, body: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically: a temporary file of our own in the same directory, renamed.

    Raises:
        OSError: when the directory is not writable.
    """
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)  # never write through a name someone else planted
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(body))
    os.replace(temp, path)


def read_small(path: str) -> bytes | None:
    """A regular file of at most 4 KiB, opened without following a symlink or blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > 4096:
            return None
        return os.read(fd, 4097)
    finally:
        os.close(fd)


def _read_json(path: Path) -> Any:
    """The JSON in ``path`` (a small regular file, not followed through a link); None if none."""
    with contextlib.suppress(OSError, ValueError):
        data = read_small(str(path))
        if data is not None:
            return json.loads(data)
    return None


def write_resize_notice(directory: Path, notice: ResizeNotice) -> None:
    """The runner: tell this node's workers the next round (replaces an older notice)."""
    _write_json(directory / RESIZE_NOTICE, notice.to_json())


def read_resize_notice(directory: Path) -> ResizeNotice | None:
    """The newest resize notice in ``directory``; None if missing or malformed."""
    body = _read_json(directory / RESIZE_NOTICE)
    if body is None:
        return None
    try:
        return ResizeNotice.from_json(body)
    except ValueError as exc:
        log.warning("ignoring the malformed %s: %s", RESIZE_NOTICE, exc)
        return None


def write_leave_notice(directory: Path, *, now: float | None = None) -> None:
    """The runner: tell this node's workers that the node leaves the job."""
    _write_json(directory / LEAVE_NOTICE, {"written_at": time.time() if now is None else now})


def read_leave_notice(directory: Path) -> LeaveNotice | None:
    """The leave notice in ``directory``; None if missing or malformed."""
    body = _read_json(directory / LEAVE_NOTICE)
    if not isinstance(body, dict):
        return None
    written = body.get("written_at")
    if isinstance(written, bool) or not isinstance(written, int | float):
        return None
    return LeaveNotice(written_at=float(written))


def write_lost_notice(directory: Path, *, round_: int, now: float | None = None) -> None:
    """The runner: tell this node's workers that a member of round ``round_`` is lost."""
    _write_json(directory / LOST_NOTICE,
                {"round": round_, "written_at": time.time() if now is None else now})


def read_lost_notice(directory: Path) -> LostNotice | None:
    """The lost notice in ``directory``; None if missing or malformed."""
    body = _read_json(directory / LOST_NOTICE)
    if not isinstance(body, dict):
        return None
    written, round_ = body.get("written_at"), body.get("round")
    if isinstance(written, bool) or not isinstance(written, int | float):
        return None
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        return None
    return LostNotice(round=round_, written_at=float(written))


def worker_live_path(directory: Path, local_rank: int) -> Path:
    """Where the worker of ``local_rank`` reports its live-path state."""
    return directory / f"{_WORKER_PREFIX}{local_rank}.json"


def write_worker_live(directory: Path, local_rank: int, live: WorkerLive) -> None:
    """The worker: report its live-path state.

    Raises:
        OSError: when the progress directory is not writable.
    """
    _write_json(worker_live_path(directory, local_rank), live.to_json())


def read_worker_live(directory: Path, local_rank: int) -> WorkerLive | None:
    """The worker's live-path state; None if missing or malformed."""
    body = _read_json(worker_live_path(directory, local_rank))
    if body is None:
        return None
    try:
        return WorkerLive.from_json(body)
    except ValueError:
        return None


def _live_files(directory: Path) -> Iterator[str]:
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            name = entry.name
            if name in (RESIZE_NOTICE, LEAVE_NOTICE, LOST_NOTICE) or (
                name.startswith(_WORKER_PREFIX)
                and name.endswith(".json")
                and name[len(_WORKER_PREFIX) : -len(".json")].isdigit()
            ):
                yield entry.path


def clear_live_files(directory: Path) -> None:
    """The runner, before a new worker group starts: remove the notices and the workers' files."""
    for path in list(_live_files(directory)):
        with contextlib.suppress(OSError):
            os.unlink(path)
