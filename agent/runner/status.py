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
generations (:mod:`agent.node.metrics`), so its counters keep counting when a new
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

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.progress import (
    RoundSpan,
    read_progress_reports,
    recovery_losses,
    round_span,
    summarize_progress,
)
from agent.runner_metrics import (
    RunnerMetricsRecorder,
    read_runner_metrics,
    write_runner_metrics,
)
from checkpoints.protocol.progress import (
    ProgressReport,
)
from rendezvous.errors import EtcdError
from rendezvous.etcd import EtcdClient
from rendezvous.records import JobNodeState, JobNodeStatus, utcnow

log = logging.getLogger(__name__)

# the reporter ------------------------------------------------------------------------


@dataclass
class _Recovery:
    started: float  # Unix time the runner noticed the failure or membership change
    baseline: int  # restart count of the workers that were running then
    reason: str | None = None  # set by the restart it leads to
    before: RoundSpan | None = None  # the round that was running then
    rendezvous_s: float = 0.0  # spent in rendezvous since



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

    def count_restart(self, reason: str, *, remaining_restarts: int | None = None) -> None:
        """Count a restart for ``reason``; ``remaining_restarts``: the budget it left,
        in the same record (the coordinator's event for a charged restart quotes it)."""
        with self._lock:
            reasons = dict(self._status.restart_reasons)
            reasons[reason] = reasons.get(reason, 0) + 1
            update: dict[str, object] = {
                "restart_reasons": reasons,
                "restart_count": self._status.restart_count + 1,
                "last_restart_reason": reason,
                "state": JobNodeState.RESTARTING,
            }
            if remaining_restarts is not None:
                update["remaining_restarts"] = remaining_restarts
            self._status = self._status.model_copy(update=update)
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
                (agent.runner.live_decide's causes); None when it was not tried.
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
                            "total_steps": summary.total_steps,
                            "paces": list(summary.paces) or None}
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
