"""The just-in-time save's files: what a worker tells its runner, and the runner's notice.

While a worker saves the last completed step after a peer died
(:mod:`checkpoints.jit`), it keeps ``<TIDAL_PROGRESS_DIR>/saving-rank-<RANK>.json``
(:class:`SavingReport`) up to date; the runner reads them (:func:`read_reports`)
and waits only while they show progress (:func:`keep_waiting`). The runner tells
the workers that a peer is gone with a notice file (:func:`write_notice`) and
clears both before a new group starts (:func:`clear_reports`). Standard library
only: the runner reads these without the library's torch half.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from checkpoints.protocol.live import read_small

__all__ = [
    "ARMED",
    "DONE",
    "FAILED",
    "NOTICE_NAME",
    "SAVING",
    "SKIPPED",
    "SavingReport",
    "clear_reports",
    "keep_waiting",
    "read_reports",
    "report_path",
    "write_notice",
    "write_report",
]

#: The runner's notice that a peer is gone (in the progress directory).
NOTICE_NAME = "peer-lost"
_REPORT = re.compile(r"^saving-rank-(\d+)\.json$")

# A report's states: armed (will save on a notice), saving, done, skipped, failed.
ARMED, SAVING, DONE, SKIPPED, FAILED = "armed", "saving", "done", "skipped", "failed"
_FINISHED = frozenset({DONE, SKIPPED, FAILED})


@dataclasses.dataclass(frozen=True)
class SavingReport:
    """What a rank tells its runner about its just-in-time save (one JSON file per rank)."""

    rank: int
    pid: int
    state: str  # armed, saving, done, skipped, failed
    step: int = -1
    bytes: int = 0
    time: float = 0.0  # time.time() of this report
    detail: str = ""

    @property
    def finished(self) -> bool:
        return self.state in _FINISHED


def report_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its report in the progress directory ``directory``."""
    return directory / f"saving-rank-{rank}.json"


def write_report(directory: Path, report: SavingReport) -> None:
    """Replace the rank's report (temporary file renamed over it; never raises)."""
    path = report_path(directory, report.rank)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        temp.write_text(json.dumps(dataclasses.asdict(report)))
        os.replace(temp, path)


def read_reports(directory: Path) -> dict[int, SavingReport]:
    """Every rank's report in ``directory``, by rank (unreadable ones skipped).

    The runner reads them from a directory its workers write: only regular
    files of a few KiB, never through a symlink nor from a FIFO.
    """
    found: dict[int, SavingReport] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not _REPORT.match(entry.name):
                continue
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                data = read_small(entry.path)
                if data is None:
                    continue
                body = json.loads(data)
                report = SavingReport(
                    rank=int(body["rank"]), pid=int(body["pid"]), state=str(body["state"]),
                    step=int(body["step"]), bytes=int(body["bytes"]), time=float(body["time"]),
                    detail=str(body.get("detail", ""))[:500],
                )
                found[report.rank] = report
    return found


def write_notice(directory: Path, reason: str) -> None:
    """The runner: tell this node's workers that a peer is gone (they save, then are stopped)."""
    temp = directory / f".{NOTICE_NAME}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        # The directory is the workers': never write through a name they may have planted.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"reason": reason, "time": time.time()}))
        os.replace(temp, directory / NOTICE_NAME)


def clear_reports(directory: Path) -> None:
    """The runner, before a new group starts: remove the notice and every saving report."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if entry.name == NOTICE_NAME or _REPORT.match(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def keep_waiting(
    reports: Mapping[int, SavingReport],
    *,
    now: float,
    noticed_at: float,
    progress_at: Mapping[int, float],
    alive: Callable[[int], bool],
    ack_s: float,
    stall_s: float,
    max_s: float,
) -> bool:
    """Whether the runner should go on waiting for its workers' just-in-time saves.

    Args:
        reports: the workers' reports, by rank.
        now: the runner's clock (``time.monotonic()``).
        noticed_at: when the runner wrote its notice.
        progress_at: for each rank, when its report last changed (``bytes`` or
            ``state``), on the same clock.
        alive: whether a process id is still running.
        ack_s: how long an armed worker has to start its save after the notice.
        stall_s: a save that shows no progress this long is given up on.
        max_s: the bound on the whole wait.

    Waits only for live processes: an armed one within ``ack_s`` of the
    notice, a saving one while it progressed within ``stall_s``; never past
    ``max_s``. A worker that does not use the checkpoints library has no
    report and costs nothing; one that hangs stops progressing and costs at
    most ``stall_s`` (``ack_s`` if it never starts).
    """
    if now - noticed_at >= max_s:
        return False
    for rank, report in reports.items():
        if report.finished or not alive(report.pid):
            continue
        if report.state == ARMED and now - noticed_at < ack_s:
            return True
        if report.state == SAVING and now - progress_at.get(rank, noticed_at) < stall_s:
            return True
    return False
