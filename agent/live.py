"""The runner's side of a live resize: its notices, its workers' answers, its decisions.

For a planned membership change (a node joins, or leaves because it is drained,
scaled down or reclaimed) the workers are healthy: instead of stopping them,
the runner forms the next rendezvous round while they train, then tells them
the new membership, and they re-form their process group at a step boundary
(the checkpoints library's live resize). The protocol lives in the workers'
progress directory (``TIDAL_PROGRESS_DIR``); every file is JSON, replaced
whole (a temporary file renamed over it):

``live-resize.json``
    written by the runner of a node that stays, once the next round formed:
    the round, its master address and port, the world size and this node's
    workers' new global ranks (:func:`write_resize_notice`);
``live-leave.json``
    written by the runner of a node that leaves (:func:`write_leave_notice`):
    its workers go on until the others resize, then exit with
    :data:`EXIT_LEFT` without saving;
``live-<local_rank>.json``
    written by each worker that can take the live path: its pid, the round it
    is in, its step and its state, ``ready``, ``resizing``, ``resized`` or
    ``left`` (:func:`read_workers`).

The decisions are pure functions of what those files say, the workers'
liveness and the clock (:func:`blocker`, :func:`resize_outcome`,
:func:`leave_outcome`); :class:`agent.runner.TidalElasticAgent` acts on them.
Whatever goes wrong falls back to the restart path, and the runner says
which path it took and why (:mod:`agent.status`).

The directory is the workers' (with ``--worker-user``, another user's): a file
is read only if it is a regular file of a few KiB, never through a symlink or
from a FIFO, and a notice is written through a fresh temporary name.

This module does not import torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

RESIZE_NOTICE = "live-resize.json"
LEAVE_NOTICE = "live-leave.json"
#: A worker's own file: ``live-<local_rank>.json``.
_WORKER_FILE = re.compile(r"live-(\d{1,6})\.json")
#: What a worker that left its group exits with (checkpoints' live resize).
EXIT_LEFT = 77

READY = "ready"
RESIZING = "resizing"
RESIZED = "resized"
LEFT = "left"

#: The most of a worker's file read: an answer is a few dozen bytes.
_MAX_BYTES = 4096

# Why the live path was not taken, or given up on (a label of
# tidal_agent_job_live_fallbacks_total: keep the set small and fixed).
NOT_CAPABLE = "not_capable"
TIMEOUT = "timeout"
WORKER_EXITED = "worker_exited"
MEMBERSHIP_CHANGED = "membership_changed"
NOT_ANNOUNCED = "not_announced"
FALLBACK_CAUSES = (NOT_CAPABLE, TIMEOUT, WORKER_EXITED, MEMBERSHIP_CHANGED, NOT_ANNOUNCED)

# Outcomes that are not a fallback.
WAITING = "waiting"
DONE = "done"


@dataclass(frozen=True)
class WorkerLive:
    """What one worker last said about the live path (``live-<local_rank>.json``)."""

    pid: int
    round: int
    step: int | None
    state: str


def worker_file(local_rank: int) -> str:
    """The name of local rank ``local_rank``'s own file."""
    return f"live-{local_rank}.json"


def _read_small(directory_fd: int, name: str) -> bytes | None:
    """A regular file of at most :data:`_MAX_BYTES`, opened without following a symlink."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=directory_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_BYTES:
            return None
        return os.read(fd, _MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_worker(data: bytes) -> WorkerLive | None:
    """A worker's answer, or None if it is not one (a reader treats it as absent)."""
    try:
        raw = json.loads(data)
        step = raw.get("step")
        worker = WorkerLive(pid=raw["pid"], round=raw["round"], step=step, state=raw["state"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    ints = (worker.pid, worker.round, *(() if step is None else (step,)))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        return None
    if worker.state not in (READY, RESIZING, RESIZED, LEFT) or worker.pid <= 0:
        return None
    return worker


def read_workers(progress_dir: Path) -> dict[int, WorkerLive]:
    """Every worker's answer in ``progress_dir``, by local rank (unreadable ones left out)."""
    found: dict[int, WorkerLive] = {}
    try:
        directory_fd = os.open(progress_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                               | os.O_CLOEXEC)
    except OSError:
        return found
    try:
        for name in os.listdir(directory_fd):
            match = _WORKER_FILE.fullmatch(name)
            if match is None:
                continue
            data = _read_small(directory_fd, name)
            worker = None if data is None else parse_worker(data)
            if worker is not None:
                found[int(match.group(1))] = worker
    except OSError:
        pass
    finally:
        os.close(directory_fd)
    return found


def _write_notice(progress_dir: Path, name: str, body: Mapping[str, object]) -> None:
    """Replace ``name`` in the workers' directory; never through a name they planted.

    Raises:
        OSError: the notice could not be written (the caller falls back).
    """
    temp = progress_dir / f".{name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(body))
    os.replace(temp, progress_dir / name)


def write_resize_notice(
    progress_dir: Path, *, round_: int, master_addr: str, master_port: int, world_size: int,
    ranks: Mapping[int, int], now: float,
) -> None:
    """Tell this node's workers the new round: they re-form their group in it.

    Raises:
        OSError: it could not be written.
    """
    _write_notice(progress_dir, RESIZE_NOTICE, {
        "round": round_, "master_addr": master_addr, "master_port": master_port,
        "world_size": world_size, "ranks": {str(lr): g for lr, g in sorted(ranks.items())},
        "written_at": now,
    })


def write_leave_notice(progress_dir: Path, *, now: float) -> None:
    """Tell this node's workers that the node leaves: they exit once the others resized.

    Raises:
        OSError: it could not be written.
    """
    _write_notice(progress_dir, LEAVE_NOTICE, {"written_at": now})


def clear_live_files(progress_dir: Path) -> None:
    """The runner, whenever its group (re)starts: no old answer or notice leaks into it."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(progress_dir):
            if entry.name in (RESIZE_NOTICE, LEAVE_NOTICE) or _WORKER_FILE.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


# decisions ---------------------------------------------------------------------------


def blocker(
    workers: Mapping[int, WorkerLive], local_ranks: Collection[int], alive: Callable[[int], bool]
) -> str | None:
    """Why this node's group cannot take the live path now; None if it can.

    It can when every local worker announced the live path (``ready``, or
    ``resized`` into an earlier round) from a process that still runs: a script
    that does not use the library, or one still starting, has no file.
    """
    if not local_ranks:
        return NOT_CAPABLE
    for local_rank in local_ranks:
        worker = workers.get(local_rank)
        if worker is None or worker.state not in (READY, RESIZED) or not alive(worker.pid):
            return NOT_CAPABLE
    return None


def resize_outcome(
    workers: Mapping[int, WorkerLive], local_ranks: Collection[int], round_: int, *,
    exited: bool, superseded: bool, now: float, deadline: float,
) -> str:
    """Where a live resize into ``round_`` stands on this node.

    Args:
        workers: the workers' answers, by local rank.
        local_ranks: this node's workers.
        round_: the round the runner told them.
        exited: a worker process of the group is gone.
        superseded: the round is obsolete already (a member lost, or the
            others went on without this node).
        now / deadline: the runner's clock and when it gives up.

    Returns:
        :data:`DONE` once every worker says ``resized`` into ``round_`` (or
        later), :data:`WAITING` while it may still come, else the fallback
        cause: :data:`WORKER_EXITED`, :data:`MEMBERSHIP_CHANGED` or
        :data:`TIMEOUT`.
    """
    if local_ranks and all(
        (w := workers.get(lr)) is not None and w.state == RESIZED and w.round >= round_
        for lr in local_ranks
    ):
        return DONE
    if exited:
        return WORKER_EXITED
    if superseded:
        return MEMBERSHIP_CHANGED
    if now >= deadline:
        return TIMEOUT
    return WAITING


def leave_outcome(
    workers: Mapping[int, WorkerLive], pids: Mapping[int, int], alive: Callable[[int], bool],
    *, now: float, deadline: float,
) -> str:
    """Where a planned leave stands: the runner waits for its workers to exit.

    Args:
        workers: the workers' answers, by local rank.
        pids: the worker processes the runner started, by local rank.
        alive: whether a process id still runs.
        now / deadline: the runner's clock and when it gives up.

    Returns:
        :data:`DONE` once every worker exited having said ``left``,
        :data:`WAITING` while they train on, :data:`WORKER_EXITED` when one
        exited without leaving (it failed: the others will not resize with
        this node gone the live way), :data:`TIMEOUT` past ``deadline``.
    """
    gone = {lr for lr, pid in pids.items() if not alive(pid)}
    left = {lr for lr, w in workers.items() if w.state == LEFT}
    if gone - left:
        return WORKER_EXITED
    if pids and gone == set(pids):
        return DONE
    if now >= deadline:
        return TIMEOUT
    return WAITING
