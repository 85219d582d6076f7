"""The coordinator's Prometheus metrics, on an injected registry.

Counters and histograms are updated by the code that does the work (the API
middleware, the reconcile loop); jobs and nodes by state, and each active
job's nodes, bounds and restarts, are read at scrape time from the reconcile
loop's last snapshot by :class:`ClusterCollector`, so nothing is kept twice.
Labels are bounded: routes are templates (``/v1/jobs/{job_id}``), never raw
paths; phases, states and reasons are enums; per-job series exist only for
jobs that have not finished (the label is ``job_id``: Prometheus reserves
``job`` for the scrape job). docs/metrics.md lists every metric; a unit test
checks it against this module.

A node that disappears is *lost* when it still ran work: a runner of a job it
was assigned had not reported stopping. An agent that stops cleanly (SIGTERM,
drain) first has its runners report ``cancelled``; one that dies (SIGKILL, a
crashed machine, a partition) leaves them ``running``. etcd shows both as the
same delete of a leased key, so the leader tells them apart from the first
snapshot taken after the delete, which holds the runners' last reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rendezvous.records import JobNodeStatus
from service.api.models import EventReason, JobPhase, JobRecord
from service.api.queues import with_default
from service.coordinator.store import Snapshot
from service.scheduler import view_usage
from service.scheduler.reports import current_statuses
from service.scheduler.stragglers import job_paces, pace_ratios

# Durations from a millisecond (an API call) to minutes (a reconcile pass under load).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Submit to first step: a start on an idle cluster takes seconds, a queue wait hours.
FIRST_STEP_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                      4 * 3600.0, 12 * 3600.0)
# The reasons the scheduler restarts a job for (JobRecord.restarts); each active
# job's counter starts at zero for every one, so increase() sees the first.
JOB_RESTART_REASONS = (EventReason.NODE_LOST, EventReason.NODE_JOINED, EventReason.NODE_DRAINED,
                       EventReason.SCALED_BY_USER, EventReason.RECLAIMED, EventReason.PREEMPTED,
                       EventReason.STRAGGLER_EVICTED)
# What a reclaim did to a job (service.scheduler), by the restart reason it counted.
RECLAIM_ACTIONS = {EventReason.RECLAIMED.value: "shrink", EventReason.PREEMPTED.value: "preempt"}
# Departures waiting for a snapshot to classify them (a non-leader never takes one).
MAX_PENDING_DEPARTURES = 1024


def _ran_work(node_id: str, assigned: dict[str, int], snap: Snapshot) -> bool:
    """Whether a departed node still ran work: a runner of its assignments had not stopped."""
    for job_id, generation in assigned.items():
        record = snap.view.jobs.get(job_id)
        if record is None or record.phase.is_terminal():
            continue
        status: JobNodeStatus | None = snap.view.statuses.get(job_id, {}).get(node_id)
        if status is None or status.generation < generation or not status.state.is_terminal():
            return True
    return False


class CoordinatorMetrics:
    """Every metric the coordinator updates as it works."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._add_api(registry)
        self._add_reconcile(registry)
        self._add_scheduling(registry)
        self._add_etcd_writes(registry)
        self._add_nodes(registry)
        self._lock = threading.Lock()
        self._assigned: dict[str, dict[str, int]] = {}  # node -> job -> generation, last pass
        self._pending: dict[str, tuple[int, dict[str, int]]] = {}  # node -> (delete rev, assigned)

    def _add_api(self, registry: CollectorRegistry) -> None:
        """The API's requests (the middleware in service.coordinator.routes.common)."""
        self.requests = Counter(
            "tidal_coordinator_http_requests_total",
            "API requests by route template, method and status code.",
            ["route", "method", "status"], registry=registry,
        )
        self.request_duration = Histogram(
            "tidal_coordinator_http_request_duration_seconds",
            "API request latency by route template and method.",
            ["route", "method"], buckets=LATENCY_BUCKETS, registry=registry,
        )

    def _add_reconcile(self, registry: CollectorRegistry) -> None:
        """The reconcile loop: leadership, each pass's time, its failures."""
        self.leader = Gauge(
            "tidal_coordinator_leader", "1 while this coordinator is the elected leader.",
            registry=registry,
        )
        self.reconcile_duration = Histogram(
            "tidal_coordinator_reconcile_duration_seconds",
            "Time of one reconcile pass: snapshot, plan and writes.",
            buckets=RECONCILE_BUCKETS, registry=registry,
        )
        self.reconcile_failures = Counter(
            "tidal_coordinator_reconcile_failures_total",
            "Reconcile passes that ended in an error (etcd unavailable, a crash); the "
            "loop retries.",
            registry=registry,
        )
        self.reconcile_consecutive_failures = Gauge(
            "tidal_coordinator_reconcile_consecutive_failures",
            "Reconcile passes that failed since the last one that completed; /readyz "
            "answers 503 from service.coordinator.reconciler.UNREADY_AFTER_FAILED_PASSES on.",
            registry=registry,
        )
        self.reconcile_last_success = Gauge(
            "tidal_coordinator_reconcile_last_success_timestamp_seconds",
            "Unix time the last reconcile pass completed (0: none yet on this replica).",
            registry=registry,
        )

    def _add_scheduling(self, registry: CollectorRegistry) -> None:
        """What the scheduler decided, and how long jobs waited for their first step."""
        self.decisions = Counter(
            "tidal_coordinator_scheduling_decisions_total",
            "Assignments written (assign) and removed (release) by the scheduler.",
            ["action"], registry=registry,
        )
        for action in ("assign", "release"):
            self.decisions.labels(action=action)
        self.stragglers = Counter(
            "tidal_coordinator_stragglers_total",
            "Straggler findings acted on (service.scheduler.stragglers), by action: evict "
            "(drained from the job live) or report (an event only).",
            ["action"], registry=registry,
        )
        for action in ("evict", "report"):
            self.stragglers.labels(action=action)
        self.first_step = Histogram(
            "tidal_coordinator_queue_first_step_seconds",
            "Seconds from a job's submission to its first step (its Training condition's "
            "first true), by queue; observed once per job by the leader.",
            ["queue"], buckets=FIRST_STEP_BUCKETS, registry=registry,
        )

    def _add_etcd_writes(self, registry: CollectorRegistry) -> None:
        """etcd calls that failed, and what the coordinator did about refused writes."""
        self.etcd_errors = Counter(
            "tidal_coordinator_etcd_errors_total",
            "etcd calls that failed, by operation.", ["op"], registry=registry,
        )
        self.job_write_failures = Counter(
            "tidal_coordinator_job_write_failures_total",
            "Job changes etcd refused (e.g. a request over its size limit); the pass went "
            "on with the other jobs.",
            registry=registry,
        )
        self.jobs_abandoned = Counter(
            "tidal_coordinator_jobs_abandoned_total",
            "Jobs failed because etcd kept refusing their writes (reason write_failed).",
            registry=registry,
        )
        self.strays_deleted = Counter(
            "tidal_coordinator_stray_assignments_deleted_total",
            "Assignments the coordinator did not write (no such job, invalid, put by "
            "hand) that it deleted.",
            registry=registry,
        )

    def _add_nodes(self, registry: CollectorRegistry) -> None:
        """Nodes that went away (:meth:`node_departed`, :meth:`observe_snapshot`)."""
        self.node_departures = Counter(
            "tidal_coordinator_node_departures_total",
            "Node records that disappeared (lease expired or agent stopped).",
            registry=registry,
        )
        self.nodes_lost = Counter(
            "tidal_coordinator_nodes_lost_total",
            "Departed nodes that still ran work for a job (died rather than stopped); "
            "counted by the leader.",
            registry=registry,
        )

    def observe_first_step(self, record: JobRecord) -> None:
        """Observe ``record``'s submit-to-first-step time if this write gave it one."""
        if record.first_step_at is not None:
            seconds = (record.first_step_at - record.created_at).total_seconds()
            self.first_step.labels(queue=record.spec.queue).observe(max(0.0, seconds))

    def node_departed(self, node_id: str, revision: int) -> None:
        """A node record was deleted at ``revision``: count it; classify it at the next pass."""
        self.node_departures.inc()
        with self._lock:
            self._pending[node_id] = (revision, dict(self._assigned.get(node_id, {})))
            while len(self._pending) > MAX_PENDING_DEPARTURES:
                self._pending.pop(next(iter(self._pending)))

    def observe_snapshot(self, snap: Snapshot) -> None:
        """Classify the departures this snapshot follows; remember who runs what."""
        view = snap.view
        with self._lock:
            for node_id, (revision, assigned) in list(self._pending.items()):
                if snap.revision < revision:
                    continue  # taken before the delete: wait for the next one
                del self._pending[node_id]
                if _ran_work(node_id, assigned, snap):
                    self.nodes_lost.inc()
            assigned_now: dict[str, dict[str, int]] = {}
            for job_id, per_node in view.assignments.items():
                for node_id, assignment in per_node.items():
                    if node_id in view.nodes:
                        assigned_now.setdefault(node_id, {})[job_id] = assignment.generation
            self._assigned = assigned_now


class ClusterCollector(Collector):
    """Jobs by phase and nodes by state, from the last snapshot a pass or probe read.

    Args:
        snapshot: returns the newest snapshot, or None before the first one.
    """

    def __init__(self, snapshot: Callable[[], Snapshot | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        jobs = GaugeMetricFamily("tidal_coordinator_jobs", "Jobs by phase.", labels=["phase"])
        nodes = GaugeMetricFamily(
            "tidal_coordinator_nodes", "Registered nodes by state.", labels=["state"]
        )
        slots = GaugeMetricFamily(
            "tidal_coordinator_slots", "Worker slots of live nodes, by use.", labels=["use"]
        )
        snap = self._snapshot()
        if snap is not None:
            view = snap.view
            counts = dict.fromkeys(JobPhase, 0)
            for record in view.jobs.values():
                counts[record.phase] += 1
            for phase, count in counts.items():
                jobs.add_metric([phase.value], count)
            draining = sum(1 for n in view.nodes if n in view.draining)
            nodes.add_metric(["live"], len(view.nodes) - draining)
            nodes.add_metric(["draining"], draining)
            total = sum(n.slots for n in view.nodes.values())
            used = sum(a.nproc_per_node for per_job in view.assignments.values()
                       for a in per_job.values())
            slots.add_metric(["total"], total)
            slots.add_metric(["used"], used)
        yield from (jobs, nodes, slots)
        yield from _per_job(snap)
        yield from _per_queue(snap)
        yield _pace_ratios(snap)


def _pace_ratios(snap: Snapshot | None) -> Metric:
    """Each node's pace ratio in each running job whose straggler policy is not off."""
    ratio = GaugeMetricFamily(
        "tidal_coordinator_node_pace_ratio",
        "Each node's pace (its slowest rank's time computing a step) over the median of "
        "its job's other nodes, as the median over the job's straggler window; for running "
        "jobs whose straggler_policy is not off, once the window is full.",
        labels=["job_id", "node_id"],
    )
    if snap is None:
        return ratio
    for record in snap.view.jobs.values():
        policy = record.spec.straggler_policy
        if record.phase != JobPhase.RUNNING or policy.mode == "off":
            continue
        reports = current_statuses(snap.view.assignments.get(record.job_id, {}),
                                   snap.view.statuses.get(record.job_id, {}))
        for node_id, value in sorted(pace_ratios(job_paces(reports),
                                                 policy.window_steps).items()):
            ratio.add_metric([record.job_id, node_id], value)
    return ratio


def _per_queue(snap: Snapshot | None) -> list[Metric]:
    """Each queue's guaranteed, used, borrowed and waiting slots, and its jobs' reclaims."""
    labels = ["queue"]
    guaranteed = GaugeMetricFamily("tidal_coordinator_queue_guaranteed_slots",
                                   "Slots each queue is guaranteed.", labels=labels)
    used = GaugeMetricFamily("tidal_coordinator_queue_used_slots",
                             "Slots each queue's jobs hold.", labels=labels)
    borrowed = GaugeMetricFamily("tidal_coordinator_queue_borrowed_slots",
                                 "Slots each queue's jobs hold beyond its guarantee.",
                                 labels=labels)
    waiting = GaugeMetricFamily("tidal_coordinator_queue_waiting_slots",
                                "Slots each queue's waiting jobs need to start.", labels=labels)
    reclaims = CounterMetricFamily(
        "tidal_coordinator_queue_reclaims",
        "Jobs of each queue shrunk (shrink) or preempted (preempt) to give slots back.",
        labels=["queue", "action"],
    )
    if snap is not None:
        view = snap.view
        queues = with_default(view.queues)
        usage = view_usage(view)
        counts = {(name, action): 0 for name in queues for action in RECLAIM_ACTIONS.values()}
        for record in view.jobs.values():
            for reason, action in RECLAIM_ACTIONS.items():
                if record.restarts.get(reason):
                    key = (record.spec.queue, action)
                    counts[key] = counts.get(key, 0) + record.restarts[reason]
        for name in sorted({*queues, *usage}):
            spec = queues.get(name)
            share = spec.guaranteed if spec is not None else 0
            held = usage.get(name)
            in_use = held.in_use if held is not None else 0
            guaranteed.add_metric([name], share)
            used.add_metric([name], in_use)
            borrowed.add_metric([name], max(0, in_use - share))
            waiting.add_metric([name], held.waiting if held is not None else 0)
        for (name, action), count in sorted(counts.items()):
            reclaims.add_metric([name, action], count)
    return [guaranteed, used, borrowed, waiting, reclaims]


def _per_job(snap: Snapshot | None) -> list[Metric]:
    """Each unfinished job's phase, nodes, bounds and scheduler restarts."""
    job = ["job_id"]
    job_phase = GaugeMetricFamily(
        "tidal_coordinator_job_phase", "1 for the phase each unfinished job is in.",
        labels=["job_id", "phase"],
    )
    job_nodes = GaugeMetricFamily(
        "tidal_coordinator_job_nodes", "Nodes assigned to each unfinished job.", labels=job
    )
    job_min = GaugeMetricFamily(
        "tidal_coordinator_job_min_nodes", "Each unfinished job's minimum number of nodes.",
        labels=job,
    )
    job_max = GaugeMetricFamily(
        "tidal_coordinator_job_max_nodes", "Each unfinished job's maximum number of nodes.",
        labels=job,
    )
    job_restarts = CounterMetricFamily(
        "tidal_coordinator_job_restarts",
        "Restarts the scheduler caused in each unfinished job (membership changes), by "
        "reason; worker failures are counted by the agents.",
        labels=["job_id", "reason"],
    )
    if snap is not None:
        for record in snap.view.jobs.values():
            if record.phase.is_terminal():
                continue
            job_id = record.job_id
            for phase in JobPhase:
                if not phase.is_terminal():
                    job_phase.add_metric([job_id, phase.value],
                                         1.0 if record.phase == phase else 0.0)
            job_nodes.add_metric([job_id], len(snap.view.assignments.get(job_id, {})))
            job_min.add_metric([job_id], record.spec.min_nodes)
            job_max.add_metric([job_id], record.spec.max_nodes)
            restarts = dict.fromkeys((r.value for r in JOB_RESTART_REASONS), 0)
            # Not the agents' charged restarts the record also counts (worker_failed):
            # the agents export those (tidal_agent_job_restarts_total).
            restarts.update((k, v) for k, v in record.restarts.items() if k in restarts)
            for reason, count in sorted(restarts.items()):
                job_restarts.add_metric([job_id, reason], count)
    return [job_phase, job_nodes, job_min, job_max, job_restarts]
