"""Report what this node does for a job: the status record in etcd and the metrics file.

The job runner calls :meth:`StatusReporter.update` at every transition
(starting, running, restarting, ...) and a background thread folds in the
workers' progress (step, last checkpoint) from the status files the
checkpoints library writes into ``TIDAL_PROGRESS_DIR``. A write happens only
when something changed, and no more often than ``min_interval_s``; terminal
states are written at once. The coordinator reads ``status/<job>/<node>``.

The same thread keeps ``<job dir>/metrics.json`` (:class:`RunnerMetrics`) up
to date: the runner's counters since it started (restarts by reason, worker
exits by code, recovery durations, torch elastic's own metrics). The agent
daemon reads those files at scrape time and sums them over the job's
generations (:mod:`agent.metrics`), so its counters keep counting when a new
generation's runner replaces the old one. The file is live data, not durable
state: written through a temporary file and a rename, never fsynced. It lives
beside the etcd record rather than in it because nothing but this node's
agent needs it, and the coordinator parses every status record on each pass.

A *recovery* is measured from the moment the runner notices a failure or a
membership change (:meth:`StatusReporter.recovery_noticed`) to the first step
completed by the workers it then starts: their progress reports carry a higher
``restart_count`` and the time of their first step (``first_step_time``), so
the figure does not depend on how often this thread polls.

This module must not import torch: the agent daemon reads the files with it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rendezvous.client import EtcdClient
from rendezvous.errors import EtcdError
from rendezvous.progress_file import (
    PROGRESS_FORMAT,
    PROGRESS_VERSION,
    ProgressReport,
    is_report_name,
)
from rendezvous.records import JobNodeState, JobNodeStatus, utcnow

log = logging.getLogger(__name__)

RUNNER_METRICS_FILE = "metrics.json"

# Recovery: gloo noticing a dead peer, the rendezvous (keep-alive x attempts),
# starting Python and torch, restoring a checkpoint: seconds to many minutes.
RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
                    180.0, 300.0, 600.0, 1200.0)
# torch elastic's profiled calls: a monitor tick (~1 ms) to a rendezvous that
# waits for its minimum number of nodes (minutes).
ELASTIC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A live resize: the runner telling its workers the new round to every worker
# re-formed its group (a step's time to the notice timeout).
LIVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Which way a membership change went on a node (agent.live), and why.
LIVE, RESTART = "live", "restart"
RESIZE_PATHS = (LIVE, RESTART)
RESIZE_REASONS = ("join", "leave", "lost")
# Why a planned change did not take the live path, or gave it up (agent.live).
NOT_CAPABLE = "not_capable"  # a worker does not take the live path (no library, starting)
TIMEOUT = "timeout"  # the workers did not answer within live_timeout
WORKER_EXITED = "worker_exited"  # a worker exited during it
MEMBERSHIP_CHANGED = "membership_changed"  # another change came meanwhile
NOT_ANNOUNCED = "not_announced"  # the leave could not be announced in the rendezvous
NO_PEER_STAYS = "no_peer_stays"  # every other member leaves too (a cancel): none to resize
FALLBACK_CAUSES = (NOT_CAPABLE, TIMEOUT, WORKER_EXITED, MEMBERSHIP_CHANGED, NOT_ANNOUNCED,
                   NO_PEER_STAYS)
# Names come from torch's code, so they are few; the cap guards the label set
# against a torch release that builds names from data.
MAX_ELASTIC_NAMES = 64


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
    )


def read_progress(progress_dir: Path) -> dict[str, int | None]:
    """The workers' newest step and the newest checkpoint step in ``progress_dir``."""
    summary = summarize_progress(read_progress_reports(progress_dir))
    return {"last_step": summary.step, "last_checkpoint_step": summary.last_checkpoint_step}


# the runner's metrics file -----------------------------------------------------------


class HistogramData(BaseModel):
    """A histogram's state: per-bucket counts (not cumulative) and the sum.

    ``counts`` has one entry per bound plus one for values above every bound.
    """

    model_config = ConfigDict(extra="forbid")

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: Iterable[float]) -> HistogramData:
        edges = sorted(float(b) for b in bounds)
        return cls(bounds=edges, counts=[0] * (len(edges) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound),
                     len(self.bounds))
        self.counts[index] += 1
        self.sum += value

    def merged(self, other: HistogramData) -> HistogramData:
        """The sum of two histograms with the same bounds.

        Raises:
            ValueError: the bounds differ (files written by another tidal version).
        """
        if other.bounds != self.bounds or len(other.counts) != len(self.counts):
            raise ValueError(f"histogram bounds differ: {self.bounds} and {other.bounds}")
        return HistogramData(
            bounds=list(self.bounds),
            counts=[a + b for a, b in zip(self.counts, other.counts, strict=True)],
            sum=self.sum + other.sum,
        )

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: ``(le, cumulative count)``, ending with ``+Inf``."""
        out = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


class ElasticCall(BaseModel):
    """One of torch elastic's profiled calls (``@prof``): outcomes and durations."""

    model_config = ConfigDict(extra="forbid")

    success: int = 0
    failure: int = 0
    duration_seconds: HistogramData = Field(
        default_factory=lambda: HistogramData.empty(ELASTIC_BUCKETS)
    )


class RunnerMetrics(BaseModel):
    """What one runner writes to ``<job dir>/metrics.json``: its counters since it started."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["tidal-runner-metrics"] = "tidal-runner-metrics"
    version: Literal[1] = 1
    job_id: str
    node_id: str
    generation: int
    pid: int
    updated_at: float = 0.0
    restarts: dict[str, int] = Field(default_factory=dict)
    worker_exits: dict[str, int] = Field(default_factory=dict)
    recovery_seconds: dict[str, HistogramData] = Field(default_factory=dict)
    elastic_calls: dict[str, ElasticCall] = Field(default_factory=dict)
    elastic_values: dict[str, float] = Field(default_factory=dict)
    # Goodput (docs/checkpoints.md): seconds the workers trained productively,
    # and seconds lost, by cause.
    productive_seconds: float = 0.0
    lost_seconds: dict[str, float] = Field(default_factory=dict)
    # Membership changes by path (live, restart) and reason (join, leave,
    # lost); the live path's fallbacks by cause (agent.live.FALLBACK_CAUSES);
    # how long the live resizes took.
    resizes: dict[str, dict[str, int]] = Field(default_factory=dict)
    live_fallbacks: dict[str, int] = Field(default_factory=dict)
    live_resize_seconds: HistogramData = Field(
        default_factory=lambda: HistogramData.empty(LIVE_BUCKETS)
    )


def read_runner_metrics(path: Path) -> RunnerMetrics | None:
    """The metrics file at ``path``, or None if it is missing or unreadable."""
    try:
        return RunnerMetrics.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.warning("ignoring the unreadable runner metrics file %s: %s", path, exc)
        return None


def elastic_call_name(metric: str) -> tuple[str, str] | None:
    """Split a ``@prof`` metric name into (call, kind), or None for a plain metric.

    ``SimpleElasticAgent._rendezvous.duration.ms`` -> ``("rendezvous", "duration.ms")``.
    """
    for kind in ("duration.ms", "success", "failure"):
        suffix = "." + kind
        if metric.endswith(suffix):
            qualname = metric[: -len(suffix)]
            return qualname.rsplit(".", 1)[-1].lstrip("_") or qualname, kind
    return None


class RunnerMetricsRecorder:
    """The runner's counters, updated from any thread; :meth:`snapshot` is what gets written.

    Args:
        job_id, node_id, generation: what the runner runs.
        pid: the runner's process id.
        seed: counters to start from (those of a runner this one replaces).
    """

    def __init__(
        self, *, job_id: str, node_id: str, generation: int, pid: int,
        seed: RunnerMetrics | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._data = RunnerMetrics(job_id=job_id, node_id=node_id, generation=generation, pid=pid)
        if seed is not None and (seed.job_id, seed.node_id, seed.generation) == (
            job_id, node_id, generation
        ):  # a dead runner's counters of this generation: go on from them
            self._data = seed.model_copy(deep=True, update={"pid": pid})
        self._version = 0
        self._warned = False

    @property
    def version(self) -> int:
        """Changes whenever the counters change."""
        with self._lock:
            return self._version

    def count_restart(self, reason: str) -> None:
        with self._lock:
            self._data.restarts[reason] = self._data.restarts.get(reason, 0) + 1
            self._version += 1

    def count_resize(self, path: str, reason: str, fallback: str | None = None) -> None:
        """Count a membership change taken on ``path``; ``fallback``: why not live."""
        with self._lock:
            by_reason = self._data.resizes.setdefault(path, {})
            by_reason[reason] = by_reason.get(reason, 0) + 1
            if fallback is not None:
                causes = self._data.live_fallbacks
                causes[fallback] = causes.get(fallback, 0) + 1
            self._version += 1

    def observe_live_resize(self, seconds: float) -> None:
        with self._lock:
            self._data.live_resize_seconds.observe(seconds)
            self._version += 1

    def count_exits(self, codes: Iterable[int]) -> None:
        """Count worker processes that exited with these codes (negative: a signal)."""
        with self._lock:
            for code in codes:
                key = str(int(code))
                self._data.worker_exits[key] = self._data.worker_exits.get(key, 0) + 1
                self._version += 1

    def add_lost(self, cause: str, seconds: float) -> None:
        """Count ``seconds`` of training time lost to ``cause``."""
        with self._lock:
            lost = self._data.lost_seconds
            lost[cause] = lost.get(cause, 0.0) + max(0.0, seconds)
            self._version += 1

    def add_productive(self, seconds: float) -> None:
        """Count ``seconds`` of productive training (negative: take back steps redone)."""
        if seconds == 0:
            return
        with self._lock:
            self._data.productive_seconds = max(0.0, self._data.productive_seconds + seconds)
            self._version += 1

    def observe_recovery(self, reason: str, seconds: float) -> None:
        with self._lock:
            hist = self._data.recovery_seconds.setdefault(
                reason, HistogramData.empty(RECOVERY_BUCKETS)
            )
            hist.observe(seconds)
            self._version += 1

    def observe_elastic(self, name: str, value: float) -> None:
        """Record one of torch elastic's ``put_metric`` values (durations in ms)."""
        parsed = elastic_call_name(name)
        with self._lock:
            data = self._data
            key = parsed[0] if parsed else name
            known = data.elastic_calls if parsed else data.elastic_values
            if key not in known and len(data.elastic_calls) + len(data.elastic_values) >= (
                MAX_ELASTIC_NAMES
            ):
                if not self._warned:
                    log.warning("more than %d torch elastic metric names; ignoring %s",
                                MAX_ELASTIC_NAMES, name)
                    self._warned = True
                return
            if parsed is None:
                data.elastic_values[name] = float(value)
            else:
                call = data.elastic_calls.setdefault(key, ElasticCall())
                if parsed[1] == "duration.ms":
                    call.duration_seconds.observe(float(value) / 1000.0)
                elif parsed[1] == "success":
                    call.success += 1
                else:
                    call.failure += 1
            self._version += 1

    def snapshot(self) -> RunnerMetrics:
        with self._lock:
            return self._data.model_copy(deep=True, update={"updated_at": time.time()})


def write_runner_metrics(path: Path, metrics: RunnerMetrics) -> None:
    """Replace ``path`` with ``metrics`` through a temporary file (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(metrics.model_dump_json(), encoding="utf-8")
    os.replace(tmp, path)


# the reporter ------------------------------------------------------------------------


@dataclass
class _Recovery:
    started: float  # Unix time the runner noticed the failure or membership change
    baseline: int  # restart count of the workers that were running then
    reason: str | None = None  # set by the restart it leads to
    before: RoundSpan | None = None  # the round that was running then
    rendezvous_s: float = 0.0  # spent in rendezvous since


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


class StatusReporter:
    """Writes one :class:`JobNodeStatus` record, throttled, and the metrics file, from a thread.

    Args:
        client: the runner's etcd client.
        status: the initial record (job, node, generation, state).
        progress_dir: where the workers' progress files are, if any.
        metrics_path: where to keep the runner's :class:`RunnerMetrics`, if anywhere.
        min_interval_s: least time between two writes of non-terminal states.
        resume_metrics: start from the counters in ``metrics_path`` (a runner
            that replaces a dead one of the same generation: the agent's
            counters, summed over these files, must not go back).
    """

    def __init__(
        self,
        client: EtcdClient,
        status: JobNodeStatus,
        *,
        progress_dir: Path | None = None,
        metrics_path: Path | None = None,
        min_interval_s: float = 1.0,
        resume_metrics: bool = False,
    ) -> None:
        self._client = client
        self._key = client.keys.status(status.job_id, status.node_id)
        self._status = status
        self._progress_dir = progress_dir
        self._metrics_path = metrics_path
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._written: dict[str, Any] | None = None
        self._last_write = 0.0
        self._recovery: _Recovery | None = None
        self._spans: dict[int, RoundSpan] = {}  # the rounds seen, by restart count
        self._credited: dict[int, tuple[float, float]] = {}  # productive, stall counted
        self._metrics_written = -1
        seed = read_runner_metrics(metrics_path) if resume_metrics and metrics_path else None
        self.recorder = RunnerMetricsRecorder(
            job_id=status.job_id, node_id=status.node_id, generation=status.generation,
            pid=os.getpid(), seed=seed,
        )
        self._thread = threading.Thread(target=self._run, name="status reporter", daemon=True)

    @property
    def status(self) -> JobNodeStatus:
        with self._lock:
            return self._status.model_copy()

    def start(self) -> StatusReporter:
        self._write()
        self._write_metrics()
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        """Change fields of the record; terminal states are written before returning."""
        with self._lock:
            self._status = self._status.model_copy(update=fields)
            terminal = self._status.state.is_terminal()
        if terminal:
            self._write()
        else:
            self._dirty.set()

    def count_restart(self, reason: str) -> None:
        with self._lock:
            reasons = dict(self._status.restart_reasons)
            reasons[reason] = reasons.get(reason, 0) + 1
            self._status = self._status.model_copy(
                update={
                    "restart_reasons": reasons,
                    "restart_count": self._status.restart_count + 1,
                    "last_restart_reason": reason,
                    "state": JobNodeState.RESTARTING,
                }
            )
            if self._recovery is not None and self._recovery.reason is None:
                self._recovery.reason = str(getattr(reason, "value", reason))
        self.recorder.count_restart(str(getattr(reason, "value", reason)))
        self._dirty.set()

    def count_resize(self, path: str, reason: str, fallback: str | None = None,
                     seconds: float | None = None) -> None:
        """A membership change was taken on ``path`` (:data:`LIVE` or :data:`RESTART`).

        Args:
            path: which way it went.
            reason: ``join``, ``leave`` or ``lost``.
            fallback: why the live path was not taken or was given up on
                (agent.live's causes); None when it was not tried.
            seconds: how long a live resize took (notice to every worker resized).
        """
        with self._lock:
            paths = dict(self._status.resize_paths)
            paths[path] = paths.get(path, 0) + 1
            last = path if fallback is None else f"{path} ({fallback})"
            self._status = self._status.model_copy(
                update={"resize_paths": paths, "last_resize": last}
            )
        self.recorder.count_resize(path, reason, fallback)
        if seconds is not None:
            self.recorder.observe_live_resize(seconds)
        log.info("membership change (%s) taken on the %s path%s", reason, path,
                 "" if fallback is None else f" ({fallback})")
        self._dirty.set()

    def recovery_noticed(self, *, restart_count: int, at: float | None = None) -> None:
        """The runner noticed a failure or a membership change; a recovery starts now.

        Args:
            restart_count: ``TORCHELASTIC_RESTART_COUNT`` of the workers running
                now; the recovery ends at the first step of workers with a higher one.
            at: when it was noticed (``time.time()``), if earlier than now (a
                live resize given up on: the recovery began with the change).

        A second notice before the workers resumed extends the same recovery.
        """
        with self._lock:
            if self._recovery is None:
                newest = max(self._spans, default=None)
                self._recovery = _Recovery(
                    started=time.time() if at is None else at, baseline=restart_count,
                    before=None if newest is None else self._spans[newest],
                )
            else:
                self._recovery.baseline = max(self._recovery.baseline, restart_count)

    def rendezvous_done(self, seconds: float) -> None:
        """A rendezvous took ``seconds``; during a recovery it counts as lost to it."""
        with self._lock:
            if self._recovery is not None:
                self._recovery.rendezvous_s += seconds

    def count_exits(self, codes: Iterable[int]) -> None:
        """Count worker processes that exited with these codes."""
        self.recorder.count_exits(codes)
        self._dirty.set()

    def close(self) -> None:
        """Write what is pending and stop the thread."""
        self._stop.set()
        self._dirty.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._client.config.timeout_s + 2)
        self._write()
        self._write_metrics()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(timeout=self._min_interval_s)
            if self._stop.is_set():
                return
            wait = self._min_interval_s - (time.monotonic() - self._last_write)
            if wait > 0 and self._stop.wait(wait):
                return
            self._dirty.clear()
            if self._progress_dir is not None:
                reports = read_progress_reports(self._progress_dir)
                summary = summarize_progress(reports)
                self._count_goodput(reports)
                self._finish_recovery(reports)
                progress = {"last_step": summary.step,
                            "last_checkpoint_step": summary.last_checkpoint_step,
                            "samples_per_second": summary.samples_per_second,
                            "loss": summary.loss,
                            "last_checkpoint_time": summary.last_checkpoint_time,
                            "total_steps": summary.total_steps}
                with self._lock:
                    changed = {k: v for k, v in progress.items() if v is not None}
                    self._status = self._status.model_copy(update=changed)
            self._write()
            self._write_metrics()

    def _count_goodput(self, reports: list[ProgressReport]) -> None:
        """Credit each round's training time (less its checkpoint stalls) as it grows."""
        for round_ in {r.round for r in reports}:
            span = round_span(reports, round_)
            if span is None:
                continue
            with self._lock:
                self._spans[round_] = span
            productive, stall = self._credited.get(round_, (0.0, 0.0))
            self.recorder.add_productive(span.productive_s - productive)
            self.recorder.add_lost("checkpoint_stall", span.stall_s - stall)
            self._credited[round_] = (span.productive_s, span.stall_s)
        data = self.recorder.snapshot()
        with self._lock:
            self._status = self._status.model_copy(update={
                "productive_seconds": round(data.productive_seconds, 3),
                "lost_seconds": {k: round(v, 3) for k, v in data.lost_seconds.items()},
            })

    def _finish_recovery(self, reports: list[ProgressReport]) -> None:
        """End the pending recovery at the first step of the workers started for it."""
        with self._lock:
            recovery = self._recovery
            if recovery is None or recovery.reason is None:
                return
            firsts = [
                t for r in reports
                if r.round > recovery.baseline and (t := r.first_step_time) is not None
            ]
            if not firsts:
                return
            seconds = max(0.0, min(firsts) - recovery.started)
            self._recovery = None
            after = round_span(reports, max(r.round for r in reports))
        if after is not None:
            losses = recovery_losses(before=recovery.before, after=after,
                                     noticed=recovery.started, rendezvous_s=recovery.rendezvous_s)
            for cause, lost in losses.items():
                self.recorder.add_lost(cause, lost)
            # The steps done again were counted as productive in the new round.
            self.recorder.add_productive(-losses.get("redone", 0.0))
        with self._lock:
            self._status = self._status.model_copy(update={"last_recovery_seconds": seconds})
        log.info("recovered from %s in %.2f s (first step of the new workers)",
                 recovery.reason, seconds)
        self.recorder.observe_recovery(recovery.reason, seconds)

    def _write_metrics(self) -> None:
        if self._metrics_path is None:
            return
        version = self.recorder.version
        if version == self._metrics_written:
            return
        try:
            write_runner_metrics(self._metrics_path, self.recorder.snapshot())
        except OSError as exc:
            log.warning("could not write %s: %s", self._metrics_path, exc)
            return
        self._metrics_written = version

    def _write(self) -> None:
        with self._lock:
            comparable = self._status.model_dump(mode="json", exclude={"updated_at"})
            if comparable == self._written:
                return
            self._status = self._status.model_copy(update={"updated_at": utcnow()})
            payload = self._status.model_dump_json().encode()
        try:
            self._client.put(self._key, payload)
        except EtcdError as exc:
            log.warning("could not write the status of %s: %s", self._key, exc)
            self._dirty.set()
            return
        with self._lock:
            self._written = comparable
            self._last_write = time.monotonic()
