"""docs/metrics.md lists exactly the metrics the code exports: names, types and labels.

The coordinator's and the agent's registries are built as the processes build
them and filled with one of everything (a job on three nodes, two runner
generations, progress files, a lost node, API requests, torch elastic calls),
then scraped. Every exported family must have a row in the tables, with the
same type and labels, and every row must be exported. The help text of a
family is not compared (the table's "meaning" may say more).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from agent.gpu.metrics import GpuCollector
from agent.gpu.nvml import GpuReading, GpuSnapshot
from agent.node.metrics import AgentMetrics, JobStatusCollector
from agent.rundir import generation_dir
from agent.runner_metrics import RunnerMetricsRecorder, write_runner_metrics
from rendezvous.gpus import GpuInfo
from rendezvous.records import JobNodeState, JobNodeStatus, WorkerError
from service.coordinator.metrics import ClusterCollector, CoordinatorMetrics
from service.coordinator.store import Snapshot
from tests.unit.agent.fakes import FakeEtcd
from tests.unit.service.sim import Sim, make_job, make_node

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
ROW = re.compile(r"^\|\s*`(tidal_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|")

Family = tuple[str, str, tuple[str, ...]]  # name as exposed, type, labels


def families(registry: CollectorRegistry) -> set[Family]:
    """What a scrape of ``registry`` exposes, by family (``_created`` series belong to theirs)."""
    generate_latest(registry)  # the exposition itself must work
    out = set()
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        out.add((name, family.type, tuple(sorted(labels))))
    return out


def coordinator_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    sim = Sim()
    sim.join(make_node("n1"), make_node("n2"))
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    sim.settle()
    for node in ("n1", "n2"):  # a full straggler window: the nodes' pace ratios
        sim.report("j", node, paces=[(s, 1.0) for s in range(20)])
    snap = Snapshot(revision=1, view=sim.view, job_revisions={"j": 1})
    metrics.observe_snapshot(snap)
    sim.kill("n2")
    metrics.node_departed("n2", 2)
    metrics.observe_snapshot(Snapshot(revision=3, view=sim.view, job_revisions={"j": 1}))
    registry.register(ClusterCollector(lambda: snap))
    metrics.requests.labels("/v1/jobs", "GET", "200").inc()
    metrics.request_duration.labels("/v1/jobs", "GET").observe(0.01)
    metrics.reconcile_duration.observe(0.01)
    metrics.etcd_errors.labels(op="reconcile").inc()
    metrics.first_step.labels(queue="default").observe(3.0)
    metrics.leader.set(1)
    return registry


def agent_registry(run_dir: Path) -> CollectorRegistry:
    client = FakeEtcd()
    client.put_status(JobNodeStatus(
        job_id="j", node_id="n", generation=1, state=JobNodeState.RUNNING, world_size=2,
        last_step=5, error=WorkerError(rank=0, exit_code=1),
    ))
    directory = generation_dir(run_dir, "j", 1)
    (directory / "progress").mkdir(parents=True)
    (directory / "progress" / "rank-0.json").write_text(json.dumps({
        "format": "tidal-progress", "version": 1,
        "rank": 0, "restart_count": 0, "time": 10.0, "step": 5, "loss": 1.0,
        "samples_per_second": 64.0, "last_checkpoint_step": 5, "last_checkpoint_time": 9.0,
        "last_save_seconds": 0.5, "last_stall_seconds": 0.01, "last_save_error": None,
    }))
    recorder = RunnerMetricsRecorder(job_id="j", node_id="n", generation=1, pid=1)
    recorder.count_restart("node_lost")
    recorder.count_exits([1])
    recorder.observe_recovery("node_lost", 10.0)
    recorder.observe_elastic("SimpleElasticAgent._rendezvous.duration.ms", 100)
    recorder.observe_elastic("SimpleElasticAgent._rendezvous.success", 1)
    recorder.observe_elastic("workers.trainer.flakiness", 0)
    write_runner_metrics(directory / "metrics.json", recorder.snapshot())
    registry = CollectorRegistry()
    AgentMetrics(registry, slots=1)
    registry.register(JobStatusCollector(client, "n", lambda: ["j"],  # type: ignore[arg-type]
                                         run_dir=run_dir, extra_restarts=lambda: {}))
    gpus = GpuSnapshot(
        (GpuInfo(index=0, uuid="GPU-0", model="m", memory_bytes=1 << 30),),
        {0: GpuReading(utilization_pct=1, memory_used_bytes=1, power_w=1, temperature_c=1)},
    )
    registry.register(GpuCollector("n", lambda: gpus, lambda: {"j": [0]}))
    return registry


def documented() -> dict[str, Family]:
    rows: dict[str, Family] = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            names = tuple(sorted(re.findall(r"[a-z_]+", labels)))
            assert name not in rows, f"{name} has two rows in {DOC}"
            rows[name] = (name, kind, names)
    return rows


def test_every_exported_metric_has_a_row_with_its_type_and_labels(tmp_path: Path) -> None:
    exported = families(coordinator_registry()) | families(agent_registry(tmp_path))
    rows = documented()
    missing = sorted(f for f in exported if rows.get(f[0]) != f)
    assert not missing, (
        f"{DOC} lacks or misdescribes these metrics; the rows should read:\n"
        + "\n".join(f"| `{n}` | {t} | {', '.join(labels)} | ... |" for n, t, labels in missing)
    )
    stale = sorted(set(rows) - {f[0] for f in exported})
    assert not stale, f"{DOC} lists metrics the code does not export: {stale}"


def test_every_metric_follows_the_naming_rules(tmp_path: Path) -> None:
    exported = families(coordinator_registry()) | families(agent_registry(tmp_path))
    for name, kind, labels in exported:
        assert name.startswith(("tidal_coordinator_", "tidal_agent_")), name
        assert (kind == "counter") == name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        assert "job" not in labels, f"{name}: 'job' is the scrape job's label; use job_id"
        assert not {"step", "error", "message", "path"} & set(labels), name
