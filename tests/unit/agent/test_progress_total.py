"""The progress a follower sees, from the worker's report to the agent's summary:
the total steps (for an estimate of the time left) travel with the other fields."""

from __future__ import annotations

import json
from pathlib import Path

from agent.progress import summarize_progress
from checkpoints.progress import FileProgressReporter, NullProgressReporter
from checkpoints.protocol.progress import ProgressReport


def test_the_total_is_reported_and_summarized_with_the_newest_round(tmp_path: Path) -> None:
    reporter = FileProgressReporter(tmp_path, rank=0, world_size=2, restart_count=1)
    reporter.set_total_steps(1000)
    reporter.record(step=7, loss=0.5, samples=64)
    reporter.flush()
    report = json.loads((tmp_path / "rank-0.json").read_text())
    assert report["total_steps"] == 1000
    stale = {**report, "restart_count": 0, "total_steps": 5000}
    reports = [ProgressReport.from_json(r) for r in (report, stale, {**report, "total_steps": "x"})]
    summary = summarize_progress([r for r in reports if r is not None])
    assert (summary.total_steps, summary.step, summary.loss) == (1000, 7, 0.5)
    reporter.set_total_steps(-3)
    reporter.flush()
    assert json.loads((tmp_path / "rank-0.json").read_text())["total_steps"] is None
    assert summarize_progress([]).total_steps is None
    NullProgressReporter().set_total_steps(10)  # a no-op outside tidal
