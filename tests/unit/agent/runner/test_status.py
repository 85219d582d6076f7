"""What a runner reports: progress summaries, metrics file, recoveries, torch elastic metrics."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic import metrics as elastic_metrics
from torch.distributed.elastic.metrics.api import NullMetricHandler

from agent.progress import (
    PROGRESS_MAX_BYTES,
    read_progress,
    read_progress_reports,
    summarize_progress,
)
from agent.runner.elastic_metrics import configure_elastic_metrics
from agent.runner.status import StatusReporter
from agent.runner_metrics import (
    RECOVERY_BUCKETS,
    HistogramData,
    RunnerMetricsRecorder,
    elastic_call_name,
    read_runner_metrics,
)
from checkpoints import progress as progress_writer
from checkpoints.progress import FileProgressReporter
from checkpoints.protocol.progress import PROGRESS_FORMAT, PROGRESS_VERSION
from rendezvous.records import JobNodeState, JobNodeStatus, RestartReason
from tests.support.wait import wait_for
from tests.unit.agent.fakes import FakeEtcd


def report(directory: Path, rank: int, **fields: Any) -> None:
    body = {"format": "tidal-progress", "version": 1, "rank": rank, "restart_count": 0,
            "time": 100.0, "step": None, **fields}
    (directory / f"rank-{rank}.json").write_text(json.dumps(body))


# progress summaries ------------------------------------------------------------------


def test_files_of_an_older_round_are_ignored_for_step_rate_and_loss(tmp_path: Path) -> None:
    # Rank 2 ran here at world size 3; after the restart this node holds rank 0 only.
    report(tmp_path, 2, restart_count=0, step=90, samples_per_second=99.0, loss=9.0, time=50.0)
    report(tmp_path, 0, restart_count=1, step=80, samples_per_second=10.0, loss=1.0, time=60.0,
           first_step_time=55.0, world_size=2)
    summary = summarize_progress(read_progress_reports(tmp_path))
    assert (summary.step, summary.samples_per_second, summary.loss) == (80, 10.0, 1.0)
    assert (summary.restart_count, summary.world_size) == (1, 2)
    assert (summary.progress_time, summary.first_step_time) == (60.0, 55.0)
    assert read_progress(tmp_path) == {"last_step": 80, "last_checkpoint_step": None}


def test_the_newest_checkpoint_counts_whichever_round_saved_it(tmp_path: Path) -> None:
    report(tmp_path, 0, restart_count=0, step=40, last_checkpoint_step=40,
           last_checkpoint_time=400.0, last_save_seconds=2.0, last_stall_seconds=0.1)
    report(tmp_path, 1, restart_count=1, step=45)
    summary = summarize_progress(read_progress_reports(tmp_path))
    assert (summary.last_checkpoint_step, summary.last_checkpoint_time) == (40, 400.0)
    assert (summary.last_save_seconds, summary.last_stall_seconds) == (2.0, 0.1)
    assert read_progress(tmp_path) == {"last_step": 45, "last_checkpoint_step": 40}


def test_losses_are_averaged_and_the_rate_is_the_largest_rank_estimate(tmp_path: Path) -> None:
    report(tmp_path, 0, step=5, loss=1.0, samples_per_second=100.0)
    report(tmp_path, 1, step=5, loss=3.0, samples_per_second=110.0, last_save_error="disk full")
    summary = summarize_progress(read_progress_reports(tmp_path))
    assert summary.loss == 2.0 and summary.samples_per_second == 110.0
    assert summary.save_failing


def test_half_written_or_foreign_files_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "rank-0.json").write_text('{"step": 3')
    (tmp_path / "rank-1.json").write_text('[1, 2]')
    report(tmp_path, 2, step=True)  # a bool is not a step
    reports = read_progress_reports(tmp_path)
    assert [r.rank for r in reports] == [2]
    assert summarize_progress(reports).step is None
    assert read_progress(tmp_path) == {"last_step": None, "last_checkpoint_step": None}


def test_the_reader_reads_every_field_the_writer_writes(tmp_path: Path) -> None:
    writer = FileProgressReporter(tmp_path, rank=3, world_size=4, restart_count=2)
    writer.record(step=7, loss=0.5, samples=8)
    writer.set_total_steps(100)
    writer.checkpoint_saved(step=5, wall_time=1000.0, save_seconds=0.5, stall_seconds=0.1)
    writer.flush()
    raw = json.loads((tmp_path / "rank-3.json").read_text())
    assert (raw["format"], raw["version"]) == (PROGRESS_FORMAT, PROGRESS_VERSION)
    assert list(raw) == list(progress_writer.PROGRESS_FIELDS)
    (written,) = read_progress_reports(tmp_path)
    assert written.to_json() == raw  # nothing the writer wrote is lost or retyped
    assert (written.rank, written.step, written.restart_count) == (3, 7, 2)
    assert (written.last_checkpoint_step, written.total_steps) == (5, 100)


def test_reports_of_another_format_or_version_are_skipped(tmp_path: Path) -> None:
    report(tmp_path, 0, step=5)
    report(tmp_path, 1, step=6, format="something-else")
    report(tmp_path, 2, step=7, version=2)
    (tmp_path / "rank-3.json").write_text(json.dumps({"rank": 3, "step": 8}))
    assert [r.rank for r in read_progress_reports(tmp_path)] == [0]


def test_a_symlinked_progress_file_is_not_followed_and_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With --worker-user the directory is the worker's: a link to a root-only
    file must not make the agent read it."""
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"format": "tidal-progress", "version": 1, "rank": 9,
                                  "step": 99}))
    progress = tmp_path / "progress"
    progress.mkdir()
    report(progress, 0, step=5)
    (progress / "rank-1.json").symlink_to(secret)
    for _ in range(3):  # every tick or scrape reads again; one warning in all
        assert [r.rank for r in read_progress_reports(progress)] == [0]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"skipping the progress file {progress}/rank-1.json: a symbolic link"]


def test_a_symlinked_progress_directory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report(elsewhere, 0, step=5)
    (tmp_path / "progress").symlink_to(elsewhere)
    assert read_progress_reports(tmp_path / "progress") == []
    assert read_progress_reports(tmp_path / "missing") == []


def test_a_fifo_is_skipped_without_blocking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.mkfifo(tmp_path / "rank-1.json")  # nobody writes: a blocking open would hang
    os.mkdir(tmp_path / "rank-2.json")
    report(tmp_path, 0, step=5)
    started = time.monotonic()
    assert [r.rank for r in read_progress_reports(tmp_path)] == [0]
    assert time.monotonic() - started < 5
    assert "rank-1.json: not a regular file" in caplog.text
    assert "rank-2.json: not a regular file" in caplog.text


def test_a_huge_progress_file_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    huge = {"format": "tidal-progress", "version": 1, "rank": 1, "step": 3,
            "pad": "x" * PROGRESS_MAX_BYTES}
    (tmp_path / "rank-1.json").write_text(json.dumps(huge))
    with open(tmp_path / "rank-2.json", "wb") as sparse:  # 1 TiB that takes no disk
        sparse.truncate(1 << 40)
    report(tmp_path, 0, step=5)
    assert [r.rank for r in read_progress_reports(tmp_path)] == [0]
    assert f"rank-1.json: larger than {PROGRESS_MAX_BYTES} bytes" in caplog.text
    assert f"rank-2.json: larger than {PROGRESS_MAX_BYTES} bytes" in caplog.text


# histograms and the recorder ---------------------------------------------------------


def test_a_histogram_counts_values_into_prometheus_buckets() -> None:
    hist = HistogramData.empty([1.0, 5.0])
    for value in (0.5, 1.0, 3.0, 7.0):
        hist.observe(value)
    assert hist.cumulative() == [("1.0", 2.0), ("5.0", 3.0), ("+Inf", 4.0)]
    assert (hist.count, hist.sum) == (4, 11.5)
    assert hist.merged(hist).cumulative()[-1] == ("+Inf", 8.0)
    with pytest.raises(ValueError, match="bounds differ"):
        hist.merged(HistogramData.empty([2.0]))


def test_torch_prof_names_become_calls_and_other_names_stay_values() -> None:
    assert elastic_call_name("SimpleElasticAgent._rendezvous.duration.ms") == (
        "rendezvous", "duration.ms")
    assert elastic_call_name("LocalElasticAgent._start_workers.failure") == (
        "start_workers", "failure")
    assert elastic_call_name("workers.trainer.flakiness") is None


def test_torch_elastic_metrics_reach_the_recorder_in_seconds() -> None:
    recorder = RunnerMetricsRecorder(job_id="j", node_id="n", generation=1, pid=1)
    configure_elastic_metrics(recorder)
    try:
        elastic_metrics.put_metric("SimpleElasticAgent._rendezvous.duration.ms", 2500)
        elastic_metrics.put_metric("SimpleElasticAgent._rendezvous.success", 1)
        elastic_metrics.put_metric("workers.trainer.flakiness", 25, "torchelastic")

        @elastic_metrics.prof
        def failing() -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            failing()
    finally:
        elastic_metrics.configure(NullMetricHandler())
    data = recorder.snapshot()
    call = data.elastic_calls["rendezvous"]
    assert (call.success, call.failure, call.duration_seconds.sum) == (1, 0, 2.5)
    assert data.elastic_calls["failing"].failure == 1
    assert data.elastic_values == {"workers.trainer.flakiness": 25.0}


def test_the_recorder_caps_the_number_of_torch_metric_names() -> None:
    recorder = RunnerMetricsRecorder(job_id="j", node_id="n", generation=1, pid=1)
    for i in range(200):
        recorder.observe_elastic(f"value.{i}", i)
    data = recorder.snapshot()
    assert len(data.elastic_values) + len(data.elastic_calls) == 64


# the reporter ------------------------------------------------------------------------


def make_reporter(tmp_path: Path, client: FakeEtcd) -> StatusReporter:
    progress = tmp_path / "progress"
    progress.mkdir(exist_ok=True)
    status = JobNodeStatus(job_id="j", node_id="n", generation=3, state=JobNodeState.STARTING)
    return StatusReporter(client, status, progress_dir=progress,  # type: ignore[arg-type]
                          metrics_path=tmp_path / "metrics.json", min_interval_s=0.05)


def _first_step_time(progress: Path, rank: int) -> float:
    return float(json.loads((progress / f"rank-{rank}.json").read_text())["first_step_time"])


def _last_step(client: FakeEtcd) -> int | None:
    try:
        return client.status("j", "n").last_step
    except KeyError:
        return None


def test_a_recovery_lasts_from_the_notice_to_the_first_step_of_the_new_workers(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    reporter = make_reporter(tmp_path, client).start()
    progress = tmp_path / "progress"
    try:
        old = FileProgressReporter(progress, rank=1, world_size=3, restart_count=0, interval=0.0)
        old.record(step=10)
        noticed = time.time() - 0.5  # noticed half a second ago: no need to wait that long
        reporter.recovery_noticed(restart_count=0, at=noticed)
        reporter.count_restart(RestartReason.NODE_LOST)
        old.record(step=11)  # a worker of the old group, still writing: not a recovery
        wait_for(lambda: _last_step(client) == 11, timeout=5,
                 what="the reporter reading the old worker's step")
        new = FileProgressReporter(progress, rank=0, world_size=2, restart_count=1, interval=0.0)
        new.record(step=8)
        data = wait_for(
            lambda: (m := read_runner_metrics(tmp_path / "metrics.json")) and m.recovery_seconds
            and m, timeout=5, what="the recovery in the metrics file")
    finally:
        reporter.close()
    hist = data.recovery_seconds["node_lost"]
    assert hist.count == 1 and hist.bounds == list(RECOVERY_BUCKETS)
    # It ended at the new worker's first step, not at the old worker's step 11.
    assert hist.sum == pytest.approx(_first_step_time(progress, 0) - noticed, abs=1e-3)
    assert data.restarts == {"node_lost": 1}
    status = client.status("j", "n")
    assert status.last_recovery_seconds == pytest.approx(hist.sum)
    assert status.last_step == 8  # the new round's step, not the old round's 11


def test_a_second_notice_before_the_workers_resume_extends_the_same_recovery(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    reporter = make_reporter(tmp_path, client).start()
    progress = tmp_path / "progress"
    try:
        noticed = time.time() - 0.4
        reporter.recovery_noticed(restart_count=0, at=noticed)
        reporter.count_restart(RestartReason.WORKER_FAILED)
        reporter.recovery_noticed(restart_count=1)  # the restarted group failed too
        reporter.count_restart(RestartReason.NODE_LOST)
        FileProgressReporter(progress, rank=0, world_size=1, restart_count=1,
                             interval=0.0).record(step=1)  # the group that failed: not it
        wait_for(lambda: _last_step(client) == 1, timeout=5,
                 what="the reporter reading the failed group's step")
        FileProgressReporter(progress, rank=0, world_size=1, restart_count=2,
                             interval=0.0).record(step=2)
        data = wait_for(
            lambda: (m := read_runner_metrics(tmp_path / "metrics.json")) and m.recovery_seconds
            and m, timeout=5, what="the recovery in the metrics file")
    finally:
        reporter.close()
    assert list(data.recovery_seconds) == ["worker_failed"]  # the reason of the first restart
    # From the first notice to the first step of the group that did not fail.
    assert data.recovery_seconds["worker_failed"].sum == pytest.approx(
        _first_step_time(progress, 0) - noticed, abs=1e-3)
    assert data.restarts == {"worker_failed": 1, "node_lost": 1}


def test_worker_exits_are_counted_by_code_and_written_on_close(tmp_path: Path) -> None:
    client = FakeEtcd()
    reporter = make_reporter(tmp_path, client).start()
    reporter.count_exits([1, -9, 1])
    reporter.count_exits(iter([0]))
    reporter.close()
    data = read_runner_metrics(tmp_path / "metrics.json")
    assert data is not None
    assert data.worker_exits == {"1": 2, "-9": 1, "0": 1}
    assert (data.job_id, data.node_id, data.generation) == ("j", "n", 3)


def test_an_unreadable_metrics_file_reads_as_none(tmp_path: Path) -> None:
    assert read_runner_metrics(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    assert read_runner_metrics(tmp_path / "bad.json") is None


def test_a_runner_replacing_a_dead_one_goes_on_from_its_counters(tmp_path: Path) -> None:
    first = make_reporter(tmp_path, FakeEtcd()).start()
    first.count_restart(RestartReason.NODE_LOST)
    first.count_exits([-9])
    first.close()
    status = JobNodeStatus(job_id="j", node_id="n", generation=3, state=JobNodeState.STARTING)
    second = StatusReporter(FakeEtcd(), status,  # type: ignore[arg-type]
                            metrics_path=tmp_path / "metrics.json", resume_metrics=True).start()
    second.count_exits([1])
    second.close()
    data = read_runner_metrics(tmp_path / "metrics.json")
    assert data is not None
    assert data.restarts == {"node_lost": 1}
    assert data.worker_exits == {"-9": 1, "1": 1}
    # A file of another generation is not this runner's to go on from.
    other = JobNodeStatus(job_id="j", node_id="n", generation=4, state=JobNodeState.STARTING)
    third = StatusReporter(FakeEtcd(), other,  # type: ignore[arg-type]
                           metrics_path=tmp_path / "metrics.json", resume_metrics=True).start()
    third.close()
    fresh = read_runner_metrics(tmp_path / "metrics.json")
    assert fresh is not None and fresh.restarts == {} and fresh.generation == 4


def test_the_path_of_each_membership_change_is_in_the_status_record_and_the_metrics(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    reporter = make_reporter(tmp_path, client).start()
    reporter.count_resize("live", "join", seconds=0.3)
    reporter.count_resize("restart", "leave", "timeout")
    reporter.close()
    status = client.status("j", "n")
    assert status.resize_paths == {"live": 1, "restart": 1}
    assert status.last_resize == "restart (timeout)"
    assert status.restart_count == 0  # a live resize restarts nothing; the runner counts restarts
    data = read_runner_metrics(tmp_path / "metrics.json")
    assert data is not None
    assert data.resizes == {"live": {"join": 1}, "restart": {"leave": 1}}
    assert data.live_fallbacks == {"timeout": 1}
    assert data.live_resize_seconds.count == 1


def test_a_recovery_after_a_live_resize_given_up_on_starts_at_the_change(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    reporter = make_reporter(tmp_path, client).start()
    try:
        reporter.recovery_noticed(restart_count=0, at=time.time() - 5.0)
        reporter.count_restart(RestartReason.NODE_JOINED)
        FileProgressReporter(tmp_path / "progress", rank=0, world_size=2, restart_count=1,
                             interval=0.0).record(step=3)
        data = wait_for(
            lambda: (m := read_runner_metrics(tmp_path / "metrics.json")) and m.recovery_seconds
            and m, timeout=5, what="the recovery in the metrics file")
    finally:
        reporter.close()
    assert data.recovery_seconds["node_joined"].sum >= 5.0


def test_a_charged_restart_and_the_budget_it_left_reach_etcd_in_one_record(
    tmp_path: Path,
) -> None:
    client = FakeEtcd()
    reporter = make_reporter(tmp_path, client).start()
    try:
        reporter.update(state=JobNodeState.RUNNING, remaining_restarts=3)
        reporter.count_restart(RestartReason.WORKER_FAILED, remaining_restarts=2)
        status = wait_for(lambda: (s := client.status("j", "n")).restart_count == 1 and s,
                          timeout=5, what="the restart in etcd")
    finally:
        reporter.close()
    # Every record with the restart counted has the budget it left (the coordinator's
    # restart_charged event quotes it): never the budget from before the restart.
    assert status.remaining_restarts == 2
    assert status.state == JobNodeState.RESTARTING
