"""Goodput: rounds of workers from their progress reports, what a recovery cost, the status line."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from agent.progress import RoundSpan, recovery_losses, round_span
from checkpoints.protocol.progress import ProgressReport
from rendezvous.records import JobNodeState, JobNodeStatus
from service.cli.views import goodput_text
from service.coordinator.views import goodput_fields


def report(round_: int, *, first: int, step: int, t0: float, t1: float,
           stall: float = 0.0) -> ProgressReport:
    return ProgressReport(restart_count=round_, first_step=first, step=step, first_step_time=t0,
                          last_step_time=t1, stall_seconds_total=stall)


def test_a_round_spans_its_ranks_first_to_last_step() -> None:
    reports = [report(1, first=51, step=80, t0=100.0, t1=103.0, stall=0.2),
               report(1, first=51, step=79, t0=100.1, t1=102.9, stall=0.0),
               report(0, first=1, step=60, t0=10.0, t1=16.0)]
    span = round_span(reports, 1)
    assert span == RoundSpan(first_step=51, last_step=80, first_time=100.0, last_time=103.0,
                             stall_s=0.2)
    assert span.step_seconds == pytest.approx(3.0 / 29)
    assert span.productive_s == pytest.approx(2.8)
    assert round_span(reports, 2) is None
    assert round_span([ProgressReport(restart_count=3, step=5)], 3) is None  # an old worker's


def test_a_recovery_splits_into_detection_rendezvous_restart_and_steps_redone() -> None:
    before = RoundSpan(first_step=1, last_step=57, first_time=0.0, last_time=5.6, stall_s=0.0)
    after = RoundSpan(first_step=51, last_step=60, first_time=12.0, last_time=13.0, stall_s=0.0)
    losses = recovery_losses(before=before, after=after, noticed=6.0, rendezvous_s=2.0)
    assert losses == pytest.approx({
        "detection": 0.4, "rendezvous": 2.0, "restart": 4.0,
        "redone": 7 * 0.1,  # resumed from 50 (first step 51), 57 were done: 7 at 0.1 s
    })
    # The just-in-time save: resumed from 57, nothing redone.
    jit = RoundSpan(first_step=58, last_step=60, first_time=12.0, last_time=12.2, stall_s=0.0)
    assert recovery_losses(before=before, after=jit, noticed=6.0, rendezvous_s=2.0)["redone"] == 0
    # No round seen before (the runner started during it): only what it saw.
    assert set(recovery_losses(before=None, after=after, noticed=6.0, rendezvous_s=9.0)) == {
        "rendezvous", "restart"}


def _status(node: str, productive: float | None, lost: dict[str, float]) -> JobNodeStatus:
    return JobNodeStatus(job_id="j", node_id=node, state=JobNodeState.RUNNING,
                         productive_seconds=productive, lost_seconds=lost,
                         updated_at=datetime.now(UTC))


def test_the_job_view_weighs_goodput_over_the_nodes() -> None:
    statuses = {"a": _status("a", 90.0, {"restart": 6.0, "redone": 4.0}),
                "b": _status("b", 100.0, {})}
    fields = goodput_fields(statuses)
    assert fields["goodput"] == pytest.approx(190 / 200)
    assert fields["lost_seconds"] == {"restart": 6.0, "redone": 4.0}
    assert goodput_fields({})["goodput"] is None


def test_the_status_line_names_the_causes() -> None:
    class View:
        goodput = 0.95
        lost_seconds = {"restart": 6.0, "redone": 4.0, "detection": 0.01}

    assert goodput_text(View()) == "95.0% (lost 10.0 s: redone 4.0, restart 6.0)"  # type: ignore[arg-type]
