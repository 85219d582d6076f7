"""The workers' progress as the runner and the daemon read it, and the goodput it gives.

Each rank's report (``<progress dir>/rank-<RANK>.json``,
:class:`checkpoints.protocol.progress.ProgressReport`) is read without trusting it
(:func:`read_progress_file`: the directory is the workers'), folded into one
:class:`ProgressSummary` (:func:`summarize_progress`), and cut into rounds of
workers (:func:`round_span`) whose gaps are the time a recovery lost, by cause
(:func:`recovery_losses`). No torch: the agent daemon reads them too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from checkpoints.protocol.progress import (
    PROGRESS_FORMAT,
    PROGRESS_VERSION,
    ProgressReport,
    is_report_name,
)

log = logging.getLogger("agent.runner.status")


# worker progress ---------------------------------------------------------------------


@dataclass(frozen=True)
class ProgressSummary:
    """What one node's workers of a job last reported, over their progress files.

    ``step``, ``samples_per_second``, ``loss``, ``progress_time`` and
    ``first_step_time`` come from the newest round only (the files with the
    highest ``restart_count``: after a restart, files of ranks that no longer
    exist here stay behind); the checkpoint fields from the newest checkpoint
    any file names. ``samples_per_second`` is the job's global rate as one rank
    measures it (the largest of this node's ranks); ``loss`` is the mean of
    this node's ranks' last losses.
    """

    step: int | None = None
    samples_per_second: float | None = None
    loss: float | None = None
    progress_time: float | None = None
    first_step_time: float | None = None
    restart_count: int | None = None
    world_size: int | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None
    last_save_seconds: float | None = None
    last_stall_seconds: float | None = None
    save_failing: bool = False
    total_steps: int | None = None
    #: The node's pace in its recent steps, ``(step, seconds)`` oldest first: at each
    #: step, its slowest rank's (the one the others waited for); see :func:`node_paces`.
    paces: tuple[tuple[int, float], ...] = ()


#: The most of a progress file read: a report is a few hundred bytes.
PROGRESS_MAX_BYTES = 256 * 1024

_warned_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def _warn_once(path: Path, reason: str) -> None:
    """Log a bad progress file once per path and reason, not at every tick or scrape."""
    key = (str(path), reason)
    with _warned_lock:
        if key in _warned:
            return
        if len(_warned) > 10_000:  # bounded: paths of finished jobs' generations
            _warned.clear()
        _warned.add(key)
    log.warning("skipping the progress file %s: %s", path, reason)


def read_progress_file(name: str, directory_fd: int, path: Path) -> ProgressReport | None:
    """One rank's report, the file ``name`` in the open directory ``directory_fd``.

    The directory belongs to the workers (with ``--worker-user``, to another
    user), so the file is not trusted: it is opened without following a
    symlink and without blocking (a FIFO), must be a regular file of at most
    :data:`PROGRESS_MAX_BYTES`, and must hold a JSON object of
    checkpoints.progress's format. Anything else is skipped with one warning
    (``path`` names it there); a file gone meanwhile is skipped quietly.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=directory_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        _warn_once(path, "a symbolic link" if exc.errno == errno.ELOOP else str(exc))
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            _warn_once(path, "not a regular file")
            return None
        if info.st_size > PROGRESS_MAX_BYTES:
            _warn_once(path, f"larger than {PROGRESS_MAX_BYTES} bytes")
            return None
        chunks = []
        left = PROGRESS_MAX_BYTES + 1  # it may have grown since fstat
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            _warn_once(path, f"larger than {PROGRESS_MAX_BYTES} bytes")
            return None
        data = json.loads(b"".join(chunks))
    except OSError as exc:
        _warn_once(path, str(exc))
        return None
    except ValueError:  # the writer renames whole files into place
        _warn_once(path, "not JSON")
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        _warn_once(path, "not a JSON object")
        return None
    report = ProgressReport.from_json(data)
    if report is None:
        _warn_once(path, f"not a {PROGRESS_FORMAT} report of version {PROGRESS_VERSION}")
    return report


def read_progress_reports(progress_dir: Path) -> list[ProgressReport]:
    """Every rank's progress report (``rank-*.json``) in ``progress_dir``.

    A missing directory gives none; a file that is not a report is skipped
    (:func:`read_progress_file`: both the runner's status thread and the
    daemon's metrics read here, and the files are the workers'). The
    directory itself is opened without following a symlink.
    """
    try:
        directory_fd = os.open(progress_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                               | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        _warn_once(progress_dir, f"cannot open the directory: {exc}")
        return []
    reports = []
    try:
        for name in sorted(os.listdir(directory_fd)):
            if is_report_name(name):
                report = read_progress_file(name, directory_fd, progress_dir / name)
                if report is not None:
                    reports.append(report)
    except OSError as exc:
        _warn_once(progress_dir, f"cannot list the directory: {exc}")
    finally:
        os.close(directory_fd)
    return reports


#: How many recent steps' paces a node reports (checkpoints.pace keeps 64 per rank).
NODE_PACE_STEPS = 64


def node_paces(reports: Iterable[ProgressReport]) -> tuple[tuple[int, float], ...]:
    """The node's pace per step over its ranks' reports: at each step the slowest rank's,
    only for steps every rank reported (the last :data:`NODE_PACE_STEPS` of them)."""
    per_rank = [dict(r.paces) for r in reports if r.paces]
    if not per_rank:
        return ()
    steps = sorted(set.intersection(*(set(p) for p in per_rank)))[-NODE_PACE_STEPS:]
    return tuple((s, max(p[s] for p in per_rank)) for s in steps)


def summarize_progress(reports: Iterable[ProgressReport]) -> ProgressSummary:
    """Fold rank reports into one :class:`ProgressSummary` (see there for the rules)."""
    every = list(reports)
    if not every:
        return ProgressSummary()
    newest = max(r.round for r in every)
    current = [r for r in every if r.round == newest]
    steps = [r.step for r in current if r.step is not None]
    rates = [r.samples_per_second for r in current if r.samples_per_second is not None]
    losses = [r.loss for r in current if r.loss is not None]
    times = [r.time for r in current if r.time is not None]
    firsts = [r.first_step_time for r in current if r.first_step_time is not None]
    sizes = [r.world_size for r in current if r.world_size is not None]
    saved = [r for r in every
             if r.last_checkpoint_time is not None or r.last_checkpoint_step is not None]
    latest = max(saved, key=lambda r: (r.last_checkpoint_time or 0.0,
                                       r.last_checkpoint_step or 0), default=None)
    return ProgressSummary(
        step=max(steps, default=None),
        samples_per_second=max(rates, default=None),
        loss=sum(losses) / len(losses) if losses else None,
        progress_time=max(times, default=None),
        first_step_time=min(firsts, default=None),
        restart_count=None if newest < 0 else newest,
        world_size=max(sizes, default=None),
        last_checkpoint_step=latest.last_checkpoint_step if latest else None,
        last_checkpoint_time=latest.last_checkpoint_time if latest else None,
        last_save_seconds=latest.last_save_seconds if latest else None,
        last_stall_seconds=latest.last_stall_seconds if latest else None,
        save_failing=any(bool(r.last_save_error) for r in current),
        total_steps=max((t for r in current if (t := r.total_steps) is not None and t >= 0),
                        default=None),
        paces=node_paces(current),
    )


def read_progress(progress_dir: Path) -> dict[str, int | None]:
    """The workers' newest step and the newest checkpoint step in ``progress_dir``."""
    summary = summarize_progress(read_progress_reports(progress_dir))
    return {"last_step": summary.step, "last_checkpoint_step": summary.last_checkpoint_step}



# goodput ------------------------------------------------------------------------------

#: Why training time was lost (docs/checkpoints.md, "Goodput").
GOODPUT_CAUSES = ("detection", "rendezvous", "restart", "redone", "checkpoint_stall")


@dataclass(frozen=True)
class RoundSpan:
    """One round of workers on this node, from their progress reports."""

    first_step: int  # the first step a worker of the round completed (resume + 1)
    last_step: int
    first_time: float  # Unix time of that first step
    last_time: float  # Unix time of the latest step
    stall_s: float  # how long checkpoint saves blocked training in the round

    @property
    def step_seconds(self) -> float | None:
        steps = self.last_step - self.first_step
        return (self.last_time - self.first_time) / steps if steps > 0 else None

    @property
    def productive_s(self) -> float:
        return max(0.0, self.last_time - self.first_time - self.stall_s)


def round_span(reports: Iterable[ProgressReport], round_: int) -> RoundSpan | None:
    """The span of round ``round_`` (a restart count) over its reports; None before a step."""
    mine = [r for r in reports if r.round == round_]
    firsts = [r.first_step for r in mine if r.first_step is not None]
    lasts = [r.step for r in mine if r.step is not None]
    first_times = [r.first_step_time for r in mine if r.first_step_time is not None]
    last_times = [r.last_step_time for r in mine if r.last_step_time is not None]
    stalls = [r.stall_seconds_total for r in mine if r.stall_seconds_total is not None]
    if not (firsts and lasts and first_times and last_times):
        return None
    return RoundSpan(first_step=min(firsts), last_step=max(lasts), first_time=min(first_times),
                     last_time=max(last_times), stall_s=max(stalls, default=0.0))


def recovery_losses(
    *, before: RoundSpan | None, after: RoundSpan, noticed: float, rendezvous_s: float
) -> dict[str, float]:
    """Seconds one recovery cost, by cause.

    detection: from the last step completed before it to the runner noticing;
    rendezvous: the rendezvous during it; restart: the rest until the new
    workers' first step (stopping, the just-in-time save, starting, restoring);
    redone: the steps the new workers do again (the last step completed before,
    less the step they resumed from), at the old round's step time.
    """
    total = max(0.0, after.first_time - noticed)
    rendezvous = min(max(0.0, rendezvous_s), total)
    losses = {"rendezvous": rendezvous, "restart": total - rendezvous}
    if before is not None:
        redone = max(0, before.last_step - (after.first_step - 1))
        step_s = before.step_seconds or after.step_seconds or 0.0
        losses["detection"] = max(0.0, noticed - before.last_time)
        losses["redone"] = redone * step_s
    return losses
