"""The per-queue metrics, read from a snapshot of a simulated cluster after a reclaim."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from service.coordinator.metrics import ClusterCollector
from service.coordinator.store import Snapshot
from tests.unit.service.scheduler.test_queues import two_teams
from tests.unit.service.scheduler.test_scheduler import running
from tests.unit.service.sim import make_job


def test_queue_metrics_show_guarantees_use_borrowing_waiting_and_reclaims() -> None:
    sim = two_teams()
    sim.submit(make_job("b1", min_nodes=1, max_nodes=3, queue="b"))
    running(sim, "b1")
    sim.submit(make_job("a1", min_nodes=2, max_nodes=2, queue="a", created=5))
    sim.report_running()
    sim.step()  # b1 shrinks to 1 node; a1 waits for the next pass
    registry = CollectorRegistry()
    registry.register(ClusterCollector(
        lambda: Snapshot(revision=1, view=sim.view, job_revisions={})))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("tidal_coordinator_queue_guaranteed_slots", queue="a") == 2
    assert value("tidal_coordinator_queue_used_slots", queue="b") == 1
    assert value("tidal_coordinator_queue_borrowed_slots", queue="b") == 0
    assert value("tidal_coordinator_queue_waiting_slots", queue="a") == 2
    assert value("tidal_coordinator_queue_reclaims_total", queue="b", action="shrink") == 1
    assert value("tidal_coordinator_queue_reclaims_total", queue="a", action="preempt") == 0
    assert value("tidal_coordinator_queue_guaranteed_slots", queue="default") == 0
    assert value("tidal_coordinator_job_restarts_total", job_id="b1", reason="reclaimed") == 1
