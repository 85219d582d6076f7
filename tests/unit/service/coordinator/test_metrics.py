"""The coordinator's metrics from reconcile snapshots: per-job gauges and lost nodes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rendezvous.records import JobNodeState
from service.coordinator.metrics import ClusterCollector, CoordinatorMetrics
from service.coordinator.store import Snapshot
from tests.unit.service.sim import Sim, make_job, make_node


class Cluster:
    """A :class:`Sim` whose every view becomes a snapshot at an increasing revision."""

    def __init__(self, *nodes: str) -> None:
        self.sim = Sim()
        self.sim.join(*(make_node(n) for n in nodes))
        self.revision = 100
        self.registry = CollectorRegistry()
        self.metrics = CoordinatorMetrics(self.registry)
        self.last: Snapshot | None = None
        self.registry.register(ClusterCollector(lambda: self.last))

    def snapshot(self) -> Snapshot:
        self.revision += 1
        view = self.sim.view
        self.last = Snapshot(revision=self.revision, view=view,
                             job_revisions={j: 1 for j in view.jobs})
        self.metrics.observe_snapshot(self.last)
        return self.last

    def node_gone(self, node_id: str) -> None:
        """The node's record is deleted (at the next revision), as the watch reports it."""
        self.sim.kill(node_id)
        self.revision += 1
        self.metrics.node_departed(node_id, self.revision)

    def sample(self, name: str, **labels: str) -> float | None:
        text = generate_latest(self.registry).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return s.value
        return None


def running_job(cluster: Cluster) -> None:
    cluster.sim.submit(make_job("j", min_nodes=2, max_nodes=3))
    cluster.sim.settle()
    cluster.snapshot()


def test_a_node_that_dies_with_its_runner_running_is_lost() -> None:
    cluster = Cluster("n1", "n2", "n3")
    running_job(cluster)
    cluster.node_gone("n3")
    assert cluster.sample("tidal_coordinator_node_departures_total") == 1
    assert cluster.sample("tidal_coordinator_nodes_lost_total") == 0  # not classified yet
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_nodes_lost_total") == 1


def test_a_node_that_stopped_its_runners_first_departed_but_was_not_lost() -> None:
    cluster = Cluster("n1", "n2", "n3")
    running_job(cluster)
    cluster.sim.report("j", "n3", JobNodeState.CANCELLED)  # SIGTERM: the runner left the job
    cluster.node_gone("n3")
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_node_departures_total") == 1
    assert cluster.sample("tidal_coordinator_nodes_lost_total") == 0


def test_an_idle_node_that_goes_is_not_lost() -> None:
    cluster = Cluster("n1", "n2", "n3", "n4")
    running_job(cluster)  # max 3 nodes: one stays idle
    idle = ({"n1", "n2", "n3", "n4"} - cluster.sim.placed("j")).pop()
    cluster.node_gone(idle)
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_nodes_lost_total") == 0


def test_a_snapshot_read_before_the_delete_does_not_classify_it() -> None:
    cluster = Cluster("n1", "n2")
    running_job(cluster)
    stale = cluster.last
    assert stale is not None
    cluster.node_gone("n2")
    cluster.metrics.observe_snapshot(stale)  # a pass that read etcd before the delete
    assert cluster.sample("tidal_coordinator_nodes_lost_total") == 0
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_nodes_lost_total") == 1


def test_unfinished_jobs_export_their_phase_nodes_bounds_and_restarts() -> None:
    cluster = Cluster("n1", "n2", "n3")
    running_job(cluster)
    assert cluster.sample("tidal_coordinator_job_nodes", job_id="j") == 3
    assert cluster.sample("tidal_coordinator_job_min_nodes", job_id="j") == 2
    assert cluster.sample("tidal_coordinator_job_max_nodes", job_id="j") == 3
    assert cluster.sample("tidal_coordinator_job_phase", job_id="j", phase="RUNNING") == 1
    assert cluster.sample("tidal_coordinator_job_phase", job_id="j", phase="PENDING") == 0
    restarts = "tidal_coordinator_job_restarts_total"
    assert cluster.sample(restarts, job_id="j", reason="node_lost") == 0  # starts at zero
    cluster.node_gone("n3")
    cluster.sim.step()
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_job_nodes", job_id="j") == 2
    assert cluster.sample(restarts, job_id="j", reason="node_lost") == 1
    assert cluster.sample("tidal_coordinator_jobs", phase="RESCALING") == 1


def test_a_finished_job_has_no_per_job_series() -> None:
    cluster = Cluster("n1", "n2")
    running_job(cluster)
    cluster.sim.cancel("j")
    cluster.sim.settle()
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_jobs", phase="CANCELLED") == 1
    assert cluster.sample("tidal_coordinator_job_nodes", job_id="j") is None
    assert cluster.sample("tidal_coordinator_job_restarts_total", job_id="j",
                          reason="node_lost") is None


def test_the_agents_charged_restarts_are_left_to_the_agents_metrics() -> None:
    cluster = Cluster("n1", "n2", "n3")
    running_job(cluster)
    cluster.sim.report("j", "n1", charged=1, remaining_restarts=2)
    cluster.sim.step()
    assert cluster.sim.job("j").restarts["worker_failed"] == 1  # the record counts them
    cluster.snapshot()
    assert cluster.sample("tidal_coordinator_job_restarts_total", job_id="j",
                          reason="worker_failed") is None
