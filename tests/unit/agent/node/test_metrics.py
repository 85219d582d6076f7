"""The agent's /metrics: status records, runner metrics files and progress files, at scrape time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.node.daemon import Agent
from agent.node.metrics import (
    RESTART_REASONS,
    AgentMetrics,
    JobStatusCollector,
)
from agent.node.settings import AgentSettings
from agent.rundir import generation_dir, generation_dirs
from agent.runner_metrics import RunnerMetricsRecorder, write_runner_metrics
from rendezvous.records import Assignment, JobNodeState, JobNodeStatus, WorkerError
from tests.unit.agent.fakes import FakeEtcd

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def runner_file(run_dir: Path, generation: int, **counts: Any) -> None:
    directory = generation_dir(run_dir, "j", generation)
    directory.mkdir(parents=True, exist_ok=True)
    recorder = RunnerMetricsRecorder(job_id="j", node_id="n", generation=generation, pid=1)
    for reason, n in counts.get("restarts", {}).items():
        for _ in range(n):
            recorder.count_restart(reason)
    recorder.count_exits(counts.get("exits", []))
    for reason, seconds in counts.get("recoveries", []):
        recorder.observe_recovery(reason, seconds)
    for name, ms in counts.get("elastic", []):
        recorder.observe_elastic(name, ms)
    write_runner_metrics(directory / "metrics.json", recorder.snapshot())


def progress_file(run_dir: Path, generation: int, rank: int, **fields: Any) -> None:
    directory = generation_dir(run_dir, "j", generation) / "progress"
    directory.mkdir(parents=True, exist_ok=True)
    body = {"format": "tidal-progress", "version": 1, "rank": rank, **fields}
    (directory / f"rank-{rank}.json").write_text(json.dumps(body))


def make_registry(
    client: FakeEtcd, run_dir: Path, extra: dict[str, dict[str, int]] | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry()
    AgentMetrics(registry, slots=2)
    registry.register(JobStatusCollector(
        client, "n", lambda: ["j"], run_dir=run_dir,  # type: ignore[arg-type]
        extra_restarts=lambda: extra or {},
    ))
    return registry


def running(generation: int = 2, **fields: Any) -> JobNodeStatus:
    return JobNodeStatus(job_id="j", node_id="n", generation=generation,
                         state=JobNodeState.RUNNING, world_size=3, **fields)


def test_counters_add_up_over_every_generation_and_the_daemons_own_restarts(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    client.put_status(running())
    runner_file(tmp_path, 1, restarts={"node_lost": 2}, exits=[1, 1],
                recoveries=[("node_lost", 9.0), ("node_lost", 12.0)],
                elastic=[("SimpleElasticAgent._rendezvous.duration.ms", 1500),
                         ("SimpleElasticAgent._rendezvous.success", 1)])
    runner_file(tmp_path, 2, restarts={"node_joined": 1}, exits=[-9],
                recoveries=[("node_joined", 8.0)],
                elastic=[("SimpleElasticAgent._rendezvous.duration.ms", 500),
                         ("SimpleElasticAgent._rendezvous.success", 1)])
    samples = scrape(make_registry(client, tmp_path, {"j": {"scaled": 1}}))

    restarts = "tidal_agent_job_restarts_total"
    assert value(samples, restarts, job_id="j", reason="node_lost") == 2
    assert value(samples, restarts, job_id="j", reason="node_joined") == 1
    assert value(samples, restarts, job_id="j", reason="scaled") == 1
    for reason in RESTART_REASONS:  # every reason starts at zero
        assert value(samples, restarts, job_id="j", reason=reason) is not None
    exits = "tidal_agent_job_worker_exits_total"
    assert value(samples, exits, job_id="j", code="1") == 2
    assert value(samples, exits, job_id="j", code="-9") == 1
    recovery = "tidal_agent_job_recovery_seconds"
    assert value(samples, recovery + "_count", job_id="j", reason="node_lost") == 2
    assert value(samples, recovery + "_sum", job_id="j", reason="node_lost") == 21.0
    assert value(samples, recovery + "_bucket", job_id="j", reason="node_lost", le="10.0") == 1
    assert value(samples, recovery + "_count", job_id="j", reason="node_joined") == 1
    calls = "tidal_agent_elastic_calls_total"
    assert value(samples, calls, job_id="j", call="rendezvous", result="success") == 2
    duration = "tidal_agent_elastic_call_duration_seconds"
    assert value(samples, duration + "_sum", job_id="j", call="rendezvous") == 2.0
    assert value(samples, duration + "_bucket", job_id="j", call="rendezvous", le="1.0") == 1
    assert value(samples, "tidal_agent_job_world_size", job_id="j") == 3
    assert value(samples, "tidal_agent_job_state", job_id="j", state="running") == 1
    assert value(samples, "tidal_agent_job_state", job_id="j", state="failed") == 0
    assert value(samples, "tidal_agent_info", node_id="n") == 1
    assert value(samples, "tidal_agent_slots") == 2


def test_progress_of_the_running_generation_is_exported(tmp_path: Path) -> None:
    client = FakeEtcd()
    client.put_status(running(last_step=41))
    progress_file(tmp_path, 1, 0, step=999, time=1.0)  # an earlier generation: ignored
    progress_file(tmp_path, 2, 0, restart_count=0, step=41, time=1000.0, loss=0.5,
                  samples_per_second=320.0, last_checkpoint_step=40,
                  last_checkpoint_time=990.0, last_save_seconds=1.5, last_stall_seconds=0.05)
    progress_file(tmp_path, 2, 1, restart_count=0, step=41, time=1001.0, loss=1.5,
                  samples_per_second=300.0)
    samples = scrape(make_registry(client, tmp_path))
    job = {"job_id": "j"}
    assert value(samples, "tidal_agent_job_step", **job) == 41
    assert value(samples, "tidal_agent_job_samples_per_second", **job) == 320.0
    assert value(samples, "tidal_agent_job_loss", **job) == 1.0
    assert value(samples, "tidal_agent_job_progress_time_seconds", **job) == 1001.0
    assert value(samples, "tidal_agent_job_last_checkpoint_step", **job) == 40
    assert value(samples, "tidal_agent_job_last_checkpoint_time_seconds", **job) == 990.0
    assert value(samples, "tidal_agent_job_last_checkpoint_save_seconds", **job) == 1.5
    assert value(samples, "tidal_agent_job_last_checkpoint_stall_seconds", **job) == 0.05
    assert value(samples, "tidal_agent_job_checkpoint_save_failing", **job) == 0


def test_a_new_generation_keeps_showing_the_last_checkpoint_until_it_saves(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    client.put_status(running(generation=1))
    progress_file(tmp_path, 1, 0, step=50, time=500.0, last_checkpoint_step=50,
                  last_checkpoint_time=480.0)
    registry = make_registry(client, tmp_path)
    assert value(scrape(registry), "tidal_agent_job_last_checkpoint_time_seconds",
                 job_id="j") == 480.0
    client.put_status(running(generation=2))
    progress_file(tmp_path, 2, 0, step=51, time=600.0)
    samples = scrape(registry)
    assert value(samples, "tidal_agent_job_last_checkpoint_time_seconds", job_id="j") == 480.0
    assert value(samples, "tidal_agent_job_last_checkpoint_step", job_id="j") == 50
    progress_file(tmp_path, 2, 0, step=60, time=700.0, last_checkpoint_step=60,
                  last_checkpoint_time=690.0)
    assert value(scrape(registry), "tidal_agent_job_last_checkpoint_time_seconds",
                 job_id="j") == 690.0


def test_a_finished_job_keeps_its_counters_but_no_world_size_or_progress(tmp_path: Path) -> None:
    client = FakeEtcd()
    error = WorkerError(rank=0, exit_code=3, message="boom")
    client.put_status(JobNodeStatus(
        job_id="j", node_id="n", generation=2, state=JobNodeState.FAILED, world_size=3,
        last_step=10, error=error))
    runner_file(tmp_path, 2, restarts={"worker_failed": 2}, exits=[3, 3, 3])
    progress_file(tmp_path, 2, 0, step=10, time=5.0, last_checkpoint_time=4.0)
    samples = scrape(make_registry(client, tmp_path))
    assert value(samples, "tidal_agent_job_world_size", job_id="j") is None
    assert value(samples, "tidal_agent_job_last_checkpoint_time_seconds", job_id="j") is None
    assert value(samples, "tidal_agent_job_state", job_id="j", state="failed") == 1
    assert value(samples, "tidal_agent_job_last_failure_exit_code", job_id="j") == 3
    assert value(samples, "tidal_agent_job_restarts_total", job_id="j",
                 reason="worker_failed") == 2
    assert value(samples, "tidal_agent_job_worker_exits_total", job_id="j", code="3") == 3


def test_without_etcd_the_counters_from_files_are_still_exported(tmp_path: Path) -> None:
    class Broken(FakeEtcd):
        def get(self, key: str) -> Any:
            from rendezvous.errors import EtcdUnavailableError
            raise EtcdUnavailableError("etcd is down")

    runner_file(tmp_path, 1, restarts={"node_lost": 1})
    samples = scrape(make_registry(Broken(), tmp_path))
    assert value(samples, "tidal_agent_job_restarts_total", job_id="j", reason="node_lost") == 1
    assert value(samples, "tidal_agent_job_world_size", job_id="j") is None


def test_the_collector_reads_where_the_daemon_runs_a_generation(tmp_path: Path) -> None:
    agent = Agent(AgentSettings(node_id="n", run_dir=tmp_path))
    assignment = Assignment(job_id="j", generation=7, command=["true"], min_nodes=1, max_nodes=1)
    assert agent._job_dir(assignment) == generation_dir(tmp_path, "j", 7)
    for generation in (10, 2, 7):
        generation_dir(tmp_path, "j", generation).mkdir(parents=True)
    (tmp_path / "jobs" / "j" / "gen-x").mkdir()
    assert generation_dirs(tmp_path, "j") == [generation_dir(tmp_path, "j", g) for g in (2, 7, 10)]


def test_the_path_each_membership_change_took_is_counted_over_generations(
    tmp_path: Path,
) -> None:
    for generation, changes in ((1, [("live", "join", None, 0.4), ("restart", "join", "timeout",
                                                                      None)]),
                                (2, [("live", "leave", None, 0.2),
                                     ("restart", "lost", None, None)])):
        directory = generation_dir(tmp_path, "j", generation)
        directory.mkdir(parents=True)
        recorder = RunnerMetricsRecorder(job_id="j", node_id="n", generation=generation, pid=1)
        for mode, reason, fallback, seconds in changes:
            recorder.count_resize(mode, reason, fallback)
            if seconds is not None:
                recorder.observe_live_resize(seconds)
        write_runner_metrics(directory / "metrics.json", recorder.snapshot())
    samples = scrape(make_registry(FakeEtcd(), tmp_path))

    resizes = "tidal_agent_job_resizes_total"
    assert value(samples, resizes, job_id="j", mode="live", reason="join") == 1
    assert value(samples, resizes, job_id="j", mode="live", reason="leave") == 1
    assert value(samples, resizes, job_id="j", mode="restart", reason="join") == 1
    assert value(samples, resizes, job_id="j", mode="restart", reason="lost") == 1
    assert value(samples, resizes, job_id="j", mode="live", reason="lost") == 0  # from zero
    fallbacks = "tidal_agent_job_live_fallbacks_total"
    assert value(samples, fallbacks, job_id="j", cause="timeout") == 1
    assert value(samples, fallbacks, job_id="j", cause="not_capable") == 0
    seconds = "tidal_agent_job_live_resize_seconds"
    assert value(samples, seconds + "_count", job_id="j") == 2
    assert value(samples, seconds + "_bucket", job_id="j", le="0.25") == 1
