"""A runner's counters, kept in ``<job dir>/metrics.json`` (:class:`RunnerMetrics`).

The runner's status thread records restarts by reason, worker exits by code,
recovery and live-resize durations and torch elastic's own metrics
(:class:`RunnerMetricsRecorder`) and writes the file; the agent daemon reads
the files of every generation at scrape time and sums them (:mod:`agent.node.metrics`).
The file is live data, not durable state: written through a temporary file
and a rename, never fsynced. No torch: the daemon reads it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("agent.runner.status")


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
# Which way a membership change went on a node (agent.runner.live_decide), and why.
LIVE, RESTART = "live", "restart"
RESIZE_PATHS = (LIVE, RESTART)
RESIZE_REASONS = ("join", "leave", "lost")
# Why a planned change did not take the live path, or gave it up (agent.runner.live_decide).
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
    # lost); the live path's fallbacks by cause (agent.runner.live_decide.FALLBACK_CAUSES);
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
