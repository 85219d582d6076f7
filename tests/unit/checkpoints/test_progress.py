"""Progress reports: the file format, the write interval, and the no-op twin outside tidal."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from checkpoints.progress import (
    PROGRESS_FIELDS,
    FileProgressReporter,
    NullProgressReporter,
    create_progress_reporter,
)


def read(path: Path) -> dict[str, object]:
    body: dict[str, object] = json.loads(path.read_text())
    return body


def test_without_the_environment_variable_reporting_is_a_no_op(tmp_path: Path) -> None:
    reporter = create_progress_reporter({"RANK": "1"})
    assert isinstance(reporter, NullProgressReporter)
    reporter.record(step=1, loss=torch.tensor(1.0), samples=4)
    reporter.flush()
    assert list(tmp_path.iterdir()) == []


def test_the_environment_names_the_directory_rank_and_restart_count(tmp_path: Path) -> None:
    reporter = create_progress_reporter(
        {
            "TIDAL_PROGRESS_DIR": str(tmp_path / "p"),
            "RANK": "3",
            "WORLD_SIZE": "4",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert isinstance(reporter, FileProgressReporter)
    reporter.record(step=7, loss=0.5, samples=8)
    body = read(tmp_path / "p" / "rank-3.json")
    assert (body["rank"], body["world_size"], body["restart_count"]) == (3, 4, 2)
    assert body["pid"] == os.getpid()


def test_the_file_has_every_documented_field_and_nothing_else(tmp_path: Path) -> None:
    reporter = FileProgressReporter(tmp_path, rank=0, world_size=2, interval=0.0)
    reporter.record(step=10, loss=torch.tensor([1.0, 3.0]), samples=32)
    reporter.checkpoint_saved(step=10, wall_time=1000.0, save_seconds=0.25, stall_seconds=0.01)
    reporter.flush()
    body = read(tmp_path / "rank-0.json")
    assert set(body) == set(PROGRESS_FIELDS)
    assert body["format"] == "tidal-progress" and body["version"] == 1
    assert body["step"] == 10
    assert body["loss"] == 2.0  # a tensor loss is reduced to its mean when written
    assert body["last_checkpoint_step"] == 10
    assert body["last_checkpoint_time"] == 1000.0
    assert body["last_save_seconds"] == 0.25 and body["last_stall_seconds"] == 0.01
    assert body["last_save_error"] is None and body["stop_requested"] is False
    assert isinstance(body["samples_per_second"], float) and body["samples_per_second"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json"]  # no temporary left


def test_writes_are_throttled_to_the_interval(tmp_path: Path) -> None:
    reporter = FileProgressReporter(tmp_path, rank=0, world_size=1, interval=3600.0)
    reporter.record(step=1)  # the first record writes
    reporter.record(step=2)
    reporter.record(step=3)
    assert read(tmp_path / "rank-0.json")["step"] == 1
    reporter.flush()
    assert read(tmp_path / "rank-0.json")["step"] == 3


def test_errors_and_stop_requests_are_reported_at_once(tmp_path: Path) -> None:
    reporter = FileProgressReporter(tmp_path, rank=0, world_size=1, interval=3600.0)
    reporter.record(step=1)
    reporter.save_failed("disk full")
    assert read(tmp_path / "rank-0.json")["last_save_error"] == "disk full"
    reporter.stop_requested()
    assert read(tmp_path / "rank-0.json")["stop_requested"] is True
    reporter.checkpoint_saved(step=2, wall_time=1.0, save_seconds=1.0, stall_seconds=0.1)
    reporter.flush()
    assert read(tmp_path / "rank-0.json")["last_save_error"] is None


def test_an_unwritable_directory_does_not_stop_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    reporter = FileProgressReporter(blocker / "sub", rank=0, world_size=1, interval=0.0)
    reporter.record(step=1, loss=1.0)  # logs a warning, raises nothing
    reporter.flush()


def test_a_progress_reporter_follows_its_new_rank_and_keeps_counting(tmp_path: Path) -> None:
    reporter = FileProgressReporter(tmp_path, rank=3, world_size=4, interval=0.0)
    reporter.record(step=5, samples=10)
    assert (tmp_path / "rank-3.json").exists()
    reporter.rebind(rank=1, world_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-1.json"]
    body = json.loads((tmp_path / "rank-1.json").read_text())
    assert (body["rank"], body["world_size"], body["pid"]) == (1, 2, os.getpid())
    assert (body["step"], body["first_step"]) == (5, 5)  # the same process, training on
    NullProgressReporter().rebind(rank=0, world_size=1)  # nothing to follow
