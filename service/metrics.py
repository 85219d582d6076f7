"""The coordinator's Prometheus metrics, on an injected registry.

Counters and histograms are updated by the code that does the work (the API
middleware, the reconcile loop); jobs and nodes by state are read at scrape
time from the reconcile loop's last snapshot by :class:`ClusterCollector`, so
every replica exports the same picture without double counting. Labels are
bounded: routes are templates (``/v1/jobs/{job_id}``), never raw paths;
phases and states are enums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from service.models import JobPhase
from service.store import Snapshot

# Durations from a millisecond (an API call) to minutes (a reconcile pass under load).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CoordinatorMetrics:
    """Every metric the coordinator updates as it works."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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
        self.reconcile_duration = Histogram(
            "tidal_coordinator_reconcile_duration_seconds",
            "Time of one reconcile pass: snapshot, plan and writes.",
            buckets=RECONCILE_BUCKETS, registry=registry,
        )
        self.decisions = Counter(
            "tidal_coordinator_scheduling_decisions_total",
            "Assignments written (assign) and removed (release) by the scheduler.",
            ["action"], registry=registry,
        )
        self.leader = Gauge(
            "tidal_coordinator_leader", "1 while this coordinator is the elected leader.",
            registry=registry,
        )
        self.etcd_errors = Counter(
            "tidal_coordinator_etcd_errors_total",
            "etcd calls that failed, by operation.", ["op"], registry=registry,
        )
        self.node_departures = Counter(
            "tidal_coordinator_node_departures_total",
            "Node records that disappeared (lease expired or agent stopped).",
            registry=registry,
        )
        for action in ("assign", "release"):
            self.decisions.labels(action=action)


class ClusterCollector(Collector):
    """Jobs by phase and nodes by state, from the last snapshot a pass or probe read.

    Args:
        snapshot: returns the newest snapshot, or None before the first one.
    """

    def __init__(self, snapshot: Callable[[], Snapshot | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
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
        yield jobs
        yield nodes
        yield slots
