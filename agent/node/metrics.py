"""The agent's Prometheus metrics, on an injected registry.

Per-job figures are read at scrape time by :class:`JobStatusCollector`, from
three places that already hold them, so a scrape always shows the current
state and nothing is double-counted across runner restarts:

* the runners' status records in etcd (``status/<job>/<node>``): state, world
  size, step, the last failure's exit code;
* each runner's ``metrics.json`` in its job directory (:class:`agent.runner_metrics.RunnerMetrics`):
  counters since that runner started -- restarts by reason, worker exits by
  code, recovery durations, torch elastic's own metrics. A job's runners are
  one per generation, each in its own directory; the collector sums the
  files of every generation, so a counter keeps counting when a new
  generation replaces the old one (finished generations' files are parsed
  once and cached);
* the workers' progress files (:mod:`checkpoints.progress`) of the running
  generation: throughput, loss, the last checkpoint and its duration.

Names follow Prometheus conventions: ``tidal_`` prefix, base units, ``_total``
for counters, histograms in seconds with explicit buckets reaching minutes.
Labels are bounded: job and node ids are validated identifiers (the job label
is ``job_id``: Prometheus reserves ``job`` for the scrape job), reasons, states
and torch's call names are enums of the code, exit codes are small integers.
docs/metrics.md lists every metric; a unit test checks it against this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agent import rundir
from agent.progress import (
    GOODPUT_CAUSES,
    ProgressSummary,
    read_progress_reports,
    summarize_progress,
)
from agent.runner_metrics import (
    FALLBACK_CAUSES,
    LIVE_BUCKETS,
    RESIZE_PATHS,
    RESIZE_REASONS,
    RUNNER_METRICS_FILE,
    HistogramData,
    RunnerMetrics,
    read_runner_metrics,
)
from rendezvous.errors import EtcdError
from rendezvous.etcd import EtcdClient
from rendezvous.records import JobNodeState, JobNodeStatus, RestartReason

log = logging.getLogger(__name__)

# Every reason a worker group restarts on a node: the runner's (worker failed,
# node lost or joined, both at once) and the daemon's (the job got a new
# generation on this node, e.g. a minimum raised above what its nodes reach:
# a new runner replaces the old one; new bounds alone are written in place and
# restart nothing). Each job's counter
# starts at zero for every reason, so increase() sees the first restart.
SCALED = "scaled"
RESTART_REASONS: tuple[str, ...] = (*(r.value for r in RestartReason), SCALED)


@dataclass
class _JobTotals:
    """A job's counters summed over its runners' metrics files."""

    restarts: dict[str, int]
    exits: dict[str, int]
    recovery: dict[str, HistogramData]
    calls: dict[str, tuple[int, int, HistogramData]]  # call -> (success, failure, durations)
    values: dict[str, float]
    productive: float = 0.0
    lost: dict[str, float] = field(default_factory=dict)
    resizes: dict[tuple[str, str], int] = field(default_factory=dict)  # (path, reason)
    fallbacks: dict[str, int] = field(default_factory=dict)
    live_seconds: HistogramData = field(default_factory=lambda: HistogramData.empty(LIVE_BUCKETS))


def _add_histogram(into: dict[str, HistogramData], key: str, hist: HistogramData) -> None:
    current = into.get(key)
    if current is None:
        into[key] = hist.model_copy(deep=True)
        return
    try:
        into[key] = current.merged(hist)
    except ValueError as exc:
        log.warning("metrics: not adding %s: %s", key, exc)


def sum_runner_metrics(files: Iterable[RunnerMetrics]) -> _JobTotals:
    """Add up the counters of several runners of one job (values: the newest file's)."""
    totals = _JobTotals({}, {}, {}, {}, {})
    for data in files:
        for reason, count in data.restarts.items():
            totals.restarts[reason] = totals.restarts.get(reason, 0) + count
        for code, count in data.worker_exits.items():
            totals.exits[code] = totals.exits.get(code, 0) + count
        for reason, hist in data.recovery_seconds.items():
            _add_histogram(totals.recovery, reason, hist)
        for name, call in data.elastic_calls.items():
            success, failure, durations = totals.calls.get(
                name, (0, 0, HistogramData.empty(call.duration_seconds.bounds))
            )
            try:
                durations = durations.merged(call.duration_seconds)
            except ValueError as exc:
                log.warning("metrics: not adding %s durations: %s", name, exc)
            totals.calls[name] = (success + call.success, failure + call.failure, durations)
        totals.values.update(data.elastic_values)
        totals.productive += data.productive_seconds
        for cause, seconds in data.lost_seconds.items():
            totals.lost[cause] = totals.lost.get(cause, 0.0) + seconds
        for path, reasons in data.resizes.items():
            for reason, count in reasons.items():
                totals.resizes[path, reason] = totals.resizes.get((path, reason), 0) + count
        for cause, count in data.live_fallbacks.items():
            totals.fallbacks[cause] = totals.fallbacks.get(cause, 0) + count
        try:
            totals.live_seconds = totals.live_seconds.merged(data.live_resize_seconds)
        except ValueError as exc:
            log.warning("metrics: not adding live resize durations: %s", exc)
    return totals


class _FileCache:
    """Parsed runner metrics files, re-read only when their size or mtime changes."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[int, int], RunnerMetrics | None]] = {}

    def read(self, path: Path) -> RunnerMetrics | None:
        try:
            st = path.stat()
        except OSError:
            self._entries.pop(path, None)
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._entries.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        data = read_runner_metrics(path)
        self._entries[path] = (stamp, data)
        return data


class _StatusFamilies:
    """The families read from the runners' status records in etcd."""

    def __init__(self) -> None:
        job = ["job_id"]
        self.info = GaugeMetricFamily(
            "tidal_agent_info", "Always 1; names the node this agent runs.", labels=["node_id"])
        self.world = GaugeMetricFamily(
            "tidal_agent_job_world_size",
            "World size (worker processes over all nodes) of the job's current round, "
            "while this node runs the job.", labels=job)
        self.state = GaugeMetricFamily(
            "tidal_agent_job_state", "1 for the state this node's share of the job is in.",
            labels=["job_id", "state"])
        self.step = GaugeMetricFamily(
            "tidal_agent_job_step", "Last training step the workers reported.", labels=job)
        self.exit_code = GaugeMetricFamily(
            "tidal_agent_job_last_failure_exit_code",
            "Exit code of the first failing worker of the job's last failure on this node.",
            labels=job)

    def all(self) -> list[Metric]:
        return [self.info, self.world, self.state, self.step, self.exit_code]


class _RunnerFamilies:
    """The families summed over the runners' metrics files: restarts, exits, torch
    elastic's own metrics, goodput and resizes."""

    def __init__(self) -> None:
        job = ["job_id"]
        self.restarts = CounterMetricFamily(
            "tidal_agent_job_restarts", "Worker group restarts on this node, by reason.",
            labels=["job_id", "reason"])
        self.exits = CounterMetricFamily(
            "tidal_agent_job_worker_exits",
            "Worker processes that exited on their own (a failure or success), by exit code "
            "(negative: killed by that signal).", labels=["job_id", "code"])
        self.recovery = HistogramMetricFamily(
            "tidal_agent_job_recovery_seconds",
            "Time from a failure or membership change noticed by this node to the first "
            "step of the workers started after it, by restart reason.",
            labels=["job_id", "reason"])
        self.calls = CounterMetricFamily(
            "tidal_agent_elastic_calls",
            "torch elastic agent calls (its @prof metrics) by call and result.",
            labels=["job_id", "call", "result"])
        self.call_seconds = HistogramMetricFamily(
            "tidal_agent_elastic_call_duration_seconds",
            "Duration of torch elastic agent calls (its duration.ms metrics, in seconds).",
            labels=["job_id", "call"])
        self.values = GaugeMetricFamily(
            "tidal_agent_elastic_metric",
            "The last value of each other torch elastic metric (put_metric).",
            labels=["job_id", "name"])
        self.productive = CounterMetricFamily(
            "tidal_agent_job_productive_seconds",
            "Seconds this node's workers trained productively (steps kept, checkpoint "
            "stalls and steps redone left out); goodput = productive / (productive + lost).",
            labels=job)
        self.lost = CounterMetricFamily(
            "tidal_agent_job_lost_seconds",
            "Seconds of this node's training lost, by cause: detection, rendezvous, restart, "
            "redone (steps done again), checkpoint_stall.", labels=["job_id", "cause"])
        self.resizes = CounterMetricFamily(
            "tidal_agent_job_resizes",
            "Membership changes this node's runner handled, by the way taken (mode live: the "
            "workers re-formed their group in place; restart: from the newest state) and "
            "reason (join, leave, lost).", labels=["job_id", "mode", "reason"])
        self.fallbacks = CounterMetricFamily(
            "tidal_agent_job_live_fallbacks",
            "Planned membership changes that took the restart path, by cause (not_capable, "
            "timeout, worker_exited, membership_changed, not_announced, no_peer_stays).",
            labels=["job_id", "cause"])
        self.live_seconds = HistogramMetricFamily(
            "tidal_agent_job_live_resize_seconds",
            "Live resizes: the runner noticing the change -> every worker of this node "
            "re-formed its group in the new round.", labels=job)

    def all(self) -> list[Metric]:
        return [self.restarts, self.exits, self.recovery, self.calls, self.call_seconds,
                self.values, self.productive, self.lost, self.resizes, self.fallbacks,
                self.live_seconds]


class _ProgressFamilies:
    """The families read from the workers' progress files: training and checkpoints."""

    def __init__(self) -> None:
        job = ["job_id"]
        self.ckpt_step = GaugeMetricFamily(
            "tidal_agent_job_last_checkpoint_step",
            "Step of the newest checkpoint the workers reported.", labels=job)
        self.ckpt_time = GaugeMetricFamily(
            "tidal_agent_job_last_checkpoint_time_seconds",
            "Unix time the newest checkpoint was committed (age: time() - this).",
            labels=job)
        self.save = GaugeMetricFamily(
            "tidal_agent_job_last_checkpoint_save_seconds",
            "Total duration of the newest checkpoint's save.", labels=job)
        self.stall = GaugeMetricFamily(
            "tidal_agent_job_last_checkpoint_stall_seconds",
            "How long the newest checkpoint's save blocked the training loop.", labels=job)
        self.save_failing = GaugeMetricFamily(
            "tidal_agent_job_checkpoint_save_failing",
            "1 while the workers' last checkpoint save failed.", labels=job)
        self.rate = GaugeMetricFamily(
            "tidal_agent_job_samples_per_second",
            "Training throughput of the whole job (global samples per second), as this "
            "node's workers measure it.", labels=job)
        self.loss = GaugeMetricFamily(
            "tidal_agent_job_loss", "Mean of this node's workers' last reported loss.",
            labels=job)
        self.progress_time = GaugeMetricFamily(
            "tidal_agent_job_progress_time_seconds",
            "Unix time of the workers' newest progress report (written after a step).",
            labels=job)

    def all(self) -> list[Metric]:
        return [self.ckpt_step, self.ckpt_time, self.save, self.stall, self.save_failing,
                self.rate, self.loss, self.progress_time]


class JobStatusCollector(Collector):
    """Exports this node's jobs at scrape time (see the module docstring).

    Args:
        client: the agent's etcd client.
        node_id: this node.
        job_ids: returns the ids of the jobs this node runs or ran.
        run_dir: the agent's run directory (runner metrics and progress files);
            without it only the etcd records are exported.
        extra_restarts: returns restarts the daemon itself counted, job -> reason -> count.
    """

    def __init__(
        self,
        client: EtcdClient,
        node_id: str,
        job_ids: Callable[[], Iterable[str]],
        *,
        run_dir: Path | None = None,
        extra_restarts: Callable[[], Mapping[str, Mapping[str, int]]] | None = None,
    ) -> None:
        self._client = client
        self._node_id = node_id
        self._job_ids = job_ids
        self._run_dir = run_dir
        self._extra_restarts = extra_restarts
        self._files = _FileCache()
        self._lock = threading.Lock()  # scrapes may overlap
        # The newest checkpoint seen per job: a new round or generation reports
        # none until it saves, but the old checkpoint is still the newest.
        self._checkpoints: dict[str, tuple[float, int | None]] = {}

    def _statuses(self, job_ids: list[str]) -> dict[str, JobNodeStatus]:
        out = {}
        for job_id in job_ids:
            kv = self._client.get(self._client.keys.status(job_id, self._node_id))
            if kv is not None:
                out[job_id] = JobNodeStatus.model_validate_json(kv.value)
        return out

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return self._collect()

    def _collect(self) -> list[Metric]:
        status, runner, progress = _StatusFamilies(), _RunnerFamilies(), _ProgressFamilies()
        status.info.add_metric([self._node_id], 1)
        job_ids = sorted(set(self._job_ids()))
        try:
            statuses = self._statuses(job_ids)
        except (EtcdError, ValueError) as exc:
            log.warning("metrics: cannot read job status from etcd: %s", exc)
            statuses = {}
        extra = self._extra_restarts() if self._extra_restarts is not None else {}
        for job_id in job_ids:
            st = statuses.get(job_id)
            if st is not None:
                self._add_status(status, st)
            self._add_counters(runner, job_id, extra.get(job_id, {}))
            if st is not None and not st.state.is_terminal() and self._run_dir is not None:
                generation = rundir.generation_dir(self._run_dir, job_id, st.generation)
                reports = read_progress_reports(rundir.progress_dir(generation))
                summary = summarize_progress(reports)
                self._add_progress(progress, job_id, summary)
        return [*status.all(), *runner.all(), *progress.all()]

    @staticmethod
    def _add_status(fam: _StatusFamilies, st: JobNodeStatus) -> None:
        job = [st.job_id]
        if not st.state.is_terminal():
            fam.world.add_metric(job, st.world_size)
        for candidate in JobNodeState:
            fam.state.add_metric([st.job_id, candidate.value],
                                 1.0 if st.state == candidate else 0.0)
        if st.last_step is not None:
            fam.step.add_metric(job, st.last_step)
        if st.error is not None:
            fam.exit_code.add_metric(job, st.error.exit_code)

    def _add_counters(self, fam: _RunnerFamilies, job_id: str, extra: Mapping[str, int]) -> None:
        files: list[RunnerMetrics] = []
        if self._run_dir is not None:
            for directory in rundir.generation_dirs(self._run_dir, job_id):
                data = self._files.read(directory / RUNNER_METRICS_FILE)
                if data is not None:
                    files.append(data)
        totals = sum_runner_metrics(files)
        restarts = dict.fromkeys(RESTART_REASONS, 0)
        for source in (totals.restarts, extra):
            for reason, count in source.items():
                restarts[reason] = restarts.get(reason, 0) + count
        for reason, count in restarts.items():
            fam.restarts.add_metric([job_id, reason], count)
        for code, count in sorted(totals.exits.items()):
            fam.exits.add_metric([job_id, code], count)
        for reason, hist in sorted(totals.recovery.items()):
            fam.recovery.add_metric([job_id, reason], hist.cumulative(), hist.sum)
        for call, (success, failure, durations) in sorted(totals.calls.items()):
            fam.calls.add_metric([job_id, call, "success"], success)
            fam.calls.add_metric([job_id, call, "failure"], failure)
            if durations.count:
                fam.call_seconds.add_metric([job_id, call], durations.cumulative(), durations.sum)
        for name, value in sorted(totals.values.items()):
            fam.values.add_metric([job_id, name], value)
        fam.productive.add_metric([job_id], totals.productive)
        lost = dict.fromkeys(GOODPUT_CAUSES, 0.0) | totals.lost
        for cause, seconds in sorted(lost.items()):
            fam.lost.add_metric([job_id, cause], seconds)
        resizes = {(p, r): 0 for p in RESIZE_PATHS for r in RESIZE_REASONS} | totals.resizes
        for (path, reason), count in sorted(resizes.items()):
            fam.resizes.add_metric([job_id, path, reason], count)
        for cause, count in sorted((dict.fromkeys(FALLBACK_CAUSES, 0) | totals.fallbacks).items()):
            fam.fallbacks.add_metric([job_id, cause], count)
        live = totals.live_seconds
        fam.live_seconds.add_metric([job_id], live.cumulative(), live.sum)

    def _add_progress(self, fam: _ProgressFamilies, job_id: str, s: ProgressSummary) -> None:
        job = [job_id]
        if s.last_checkpoint_time is not None:
            known = self._checkpoints.get(job_id)
            if known is None or s.last_checkpoint_time >= known[0]:
                self._checkpoints[job_id] = (s.last_checkpoint_time, s.last_checkpoint_step)
        checkpoint = self._checkpoints.get(job_id)
        if checkpoint is not None:
            fam.ckpt_time.add_metric(job, checkpoint[0])
            if checkpoint[1] is not None:
                fam.ckpt_step.add_metric(job, checkpoint[1])
        if s.last_save_seconds is not None:
            fam.save.add_metric(job, s.last_save_seconds)
        if s.last_stall_seconds is not None:
            fam.stall.add_metric(job, s.last_stall_seconds)
        fam.save_failing.add_metric(job, 1.0 if s.save_failing else 0.0)
        if s.samples_per_second is not None:
            fam.rate.add_metric(job, s.samples_per_second)
        if s.loss is not None:
            fam.loss.add_metric(job, s.loss)
        if s.progress_time is not None:
            fam.progress_time.add_metric(job, s.progress_time)


class AgentMetrics:
    """The agent process's own metrics, and the restarts only the daemon sees."""

    def __init__(self, registry: CollectorRegistry, *, slots: int) -> None:
        self.registry = registry
        self.up = Gauge("tidal_agent_up", "1 while the agent runs.", registry=registry)
        self.slots = Gauge("tidal_agent_slots", "Worker processes this node may run.",
                           registry=registry)
        self.slots_used = Gauge("tidal_agent_slots_used", "Worker processes assigned now.",
                                registry=registry)
        self.started = Gauge("tidal_agent_start_time_seconds", "Unix time the agent started.",
                             registry=registry)
        self.up.set(1)
        self.slots.set(slots)
        self.started.set(time.time())
        self._restarts_lock = threading.Lock()
        self._restarts: dict[str, dict[str, int]] = {}

    def count_restart(self, job_id: str, reason: str) -> None:
        """Count a restart the daemon caused (a new generation replaced the runner)."""
        with self._restarts_lock:
            per_job = self._restarts.setdefault(job_id, {})
            per_job[reason] = per_job.get(reason, 0) + 1

    def restarts(self) -> dict[str, dict[str, int]]:
        """The daemon's restarts so far, job -> reason -> count (a copy)."""
        with self._restarts_lock:
            return {job: dict(reasons) for job, reasons in self._restarts.items()}

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve /metrics on ``port`` (0 picks one: read it from the server)."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        return server, thread
