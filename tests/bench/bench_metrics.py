"""Benchmark: what progress reporting and the metrics endpoints cost a training step.

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/bench/bench_metrics.py -m bench -s``.
It prints a table (median and worst) of:

* a training step (a ~1M-parameter MLP, Adam, CPU) with progress reporting
  off (the no-op twin), on (``FileProgressReporter``, one file write per
  second, as under tidal), and on while another process scrapes an agent's
  ``/metrics`` for this job ten times a second (ten times what a 1 s scrape
  interval costs; the agent reads the progress files at scrape time). Rounds
  alternate, so that drift of the machine hits every variant alike;
* ``record()`` alone per call (the per-step cost when no file is due), and one
  file write (``flush()``);
* one scrape of an agent's registry, collected in-process: 1 job, and 20 jobs
  (each with a status record, two runner metrics files and 3 progress files);
* one tick of the runner's status thread (read and fold the progress files).

The figures go into docs/benchmarks.md ("Metrics cost"). No assertion is made on time.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from agent.node.metrics import AgentMetrics, JobStatusCollector
from agent.progress import read_progress_reports, summarize_progress
from agent.rundir import generation_dir
from agent.runner_metrics import RunnerMetricsRecorder, write_runner_metrics
from checkpoints.progress import FileProgressReporter, NullProgressReporter, ProgressReporter
from rendezvous.records import JobNodeState, JobNodeStatus
from tests.unit.agent.fakes import FakeEtcd

WIDTH, LAYERS, BATCH = 512, 4, 64  # 4 x 512^2 weights: ~1.05M parameters
STEPS, ROUNDS = 300, 5
SCRAPE_EVERY_S = 0.1


def make_step() -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    step()
    return step


def timed_loop(step: Callable[[], torch.Tensor], reporter: ProgressReporter) -> list[float]:
    times = []
    for i in range(STEPS):
        started = time.perf_counter()
        loss = step()
        reporter.record(step=i + 1, loss=loss, samples=BATCH)
        times.append(time.perf_counter() - started)
    return times


def fill_run_dir(run_dir: Path, client: FakeEtcd, jobs: int) -> list[str]:
    """``jobs`` running jobs on node n: status records, runner files, progress files."""
    ids = [f"job-{i}" for i in range(jobs)]
    for job_id in ids:
        client.put_status(JobNodeStatus(job_id=job_id, node_id="n", generation=2,
                                        state=JobNodeState.RUNNING, world_size=3, last_step=100))
        for generation in (1, 2):
            directory = generation_dir(run_dir, job_id, generation)
            (directory / "progress").mkdir(parents=True)
            recorder = RunnerMetricsRecorder(job_id=job_id, node_id="n",
                                             generation=generation, pid=1)
            recorder.count_restart("node_lost")
            recorder.observe_recovery("node_lost", 10.0)
            for call in ("rendezvous", "start_workers", "monitor_workers", "run"):
                recorder.observe_elastic(f"SimpleElasticAgent._{call}.duration.ms", 5)
                recorder.observe_elastic(f"SimpleElasticAgent._{call}.success", 1)
            write_runner_metrics(directory / "metrics.json", recorder.snapshot())
            for rank in range(3):
                (directory / "progress" / f"rank-{rank}.json").write_text(json.dumps({
                    "format": "tidal-progress", "version": 1,
                    "rank": rank, "restart_count": 0, "time": time.time(), "step": 100,
                    "loss": 0.5, "samples_per_second": 1000.0, "last_checkpoint_step": 100,
                    "last_checkpoint_time": time.time(), "last_save_seconds": 1.0,
                    "last_stall_seconds": 0.01,
                }))
    return ids


def agent_registry(run_dir: Path, client: Any, job_ids: list[str]) -> CollectorRegistry:
    registry = CollectorRegistry()
    AgentMetrics(registry, slots=4)
    registry.register(JobStatusCollector(client, "n", lambda: job_ids, run_dir=run_dir))
    return registry


def scrape_agent(run_dir: str, stop_file: str, ready_file: str) -> None:
    """In another process: serve an agent's /metrics for job-0 and scrape it every 0.1 s."""
    root = Path(run_dir)
    client = FakeEtcd()
    client.put_status(JobNodeStatus(job_id="job-0", node_id="n", generation=1,
                                    state=JobNodeState.RUNNING, world_size=1))
    server, _ = start_http_server(0, addr="127.0.0.1",
                                  registry=agent_registry(root, client, ["job-0"]))
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    Path(ready_file).write_text(url)
    with httpx.Client(timeout=5) as http:
        while not Path(stop_file).exists():
            http.get(url).raise_for_status()
            time.sleep(SCRAPE_EVERY_S)
    server.shutdown()


def row(name: str, values: list[float], unit: float = 1.0, fmt: str = "{:8.3f}") -> str:
    med, worst = statistics.median(values) * unit, max(values) * unit
    return f"| {name:<56} | {fmt.format(med)} | {fmt.format(worst)} |"


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_bench_progress_reporting_and_metrics_endpoints(tmp_path: Path) -> None:
    step = make_step()
    params = sum(WIDTH * WIDTH + WIDTH for _ in range(LAYERS))
    progress = generation_dir(tmp_path / "scraped", "job-0", 1) / "progress"
    progress.mkdir(parents=True)
    variants: dict[str, list[float]] = {"off": [], "on": [], "on + scrapes": []}
    totals: dict[str, list[float]] = {k: [] for k in variants}
    ctx = mp.get_context("spawn")
    for r in range(ROUNDS):
        for name in variants:
            if name == "off":
                reporter: ProgressReporter = NullProgressReporter()
            else:
                reporter = FileProgressReporter(progress, rank=0, world_size=1, restart_count=0)
            scraper = None
            if name == "on + scrapes":
                stop, ready = tmp_path / f"stop-{r}", tmp_path / f"ready-{r}"
                scraper = ctx.Process(target=scrape_agent,
                                      args=(str(tmp_path / "scraped"), str(stop), str(ready)))
                scraper.start()
                deadline = time.monotonic() + 60
                while not ready.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            times = timed_loop(step, reporter)
            if scraper is not None:
                stop.touch()
                scraper.join(timeout=30)
                assert scraper.exitcode == 0
            variants[name] += times
            totals[name].append(sum(times))
    base = statistics.median(variants["off"])

    reporter = FileProgressReporter(tmp_path / "alone", rank=0, world_size=1, interval=3600.0)
    loss = torch.tensor(1.0)
    reporter.record(step=0, loss=loss, samples=BATCH)
    started = time.perf_counter()
    for i in range(100_000):
        reporter.record(step=i, loss=loss, samples=BATCH)
    per_record = (time.perf_counter() - started) / 100_000
    flushes = timed(reporter.flush, 200)

    client = FakeEtcd()
    one = agent_registry(tmp_path / "one", client, fill_run_dir(tmp_path / "one", client, 1))
    many = agent_registry(tmp_path / "many", client, fill_run_dir(tmp_path / "many", client, 20))
    scrape_one = timed(lambda: generate_latest(one), 200)
    scrape_many = timed(lambda: generate_latest(many), 50)
    tick_dir = generation_dir(tmp_path / "many", "job-0", 2) / "progress"
    ticks = timed(lambda: summarize_progress(read_progress_reports(tick_dir)), 500)
    size = len(generate_latest(many))

    def overhead(name: str) -> list[float]:
        return [t / statistics.median(totals["off"]) - 1.0 for t in totals[name]]

    lines = [
        f"model: {params / 1e6:.2f}M parameters + Adam, batch {BATCH}, "
        f"{torch.get_num_threads()} threads; {STEPS} steps x {ROUNDS} rounds per variant",
        "| measure | median | worst |",
        "|---|---|---|",
        row("training step, reporting off (ms)", variants["off"], 1e3),
        row("training step, reporting on (ms)", variants["on"], 1e3),
        row("training step, on + /metrics scraped at 10 Hz (ms)", variants["on + scrapes"], 1e3),
        row("loop total vs off: reporting on (%)", overhead("on"), 100, "{:8.2f}"),
        row("loop total vs off: on + scrapes (%)", overhead("on + scrapes"), 100, "{:8.2f}"),
        row("record() when no write is due (us)", [per_record], 1e6, "{:8.2f}"),
        row("record() / step (%)", [per_record / base], 100, "{:8.4f}"),
        row("one progress file write, flush() (us)", flushes, 1e6, "{:8.1f}"),
        row("agent scrape, 1 job, in-process (ms)", scrape_one, 1e3),
        row(f"agent scrape, 20 jobs ({size // 1024} KiB), in-process (ms)", scrape_many, 1e3),
        row("runner status tick: fold 3 progress files (ms)", ticks, 1e3),
    ]
    print("\n" + "\n".join(lines))
    assert variants["on"] and scrape_one
