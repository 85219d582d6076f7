"""What a follower shows: progress formatting (pure), the console's bar and plain
lines, the log route's lines and their parsing."""

from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from service.api.models import (
    EventReason,
    JobEvent,
    JobPhase,
    JobRecord,
    JobSpec,
    JobView,
    SpecView,
)
from service.cli.console import (
    FollowConsole,
    Progress,
    StepRate,
    duration,
    parse_log_line,
    progress_bar,
    progress_line,
    progress_of,
    should_print,
    throughput,
)
from service.coordinator.routes.logs import nodes_of_job, output_line, tidal_line

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)


def _view(**fields: Any) -> JobView:
    spec = JobSpec(name="t", command=["python", "t.py"])
    base: dict[str, Any] = dict(
        job_id="t-0123abcd", spec=SpecView.of(spec), phase=JobPhase.RUNNING,
        cancel_requested=False, conditions=[], world_size=4, nodes=[], restarts={},
        restart_count=0, last_step=None, last_checkpoint_step=None, exit_reason=None,
        error=None, created_at=NOW, started_at=NOW, finished_at=None,
    )
    base.update(fields)
    return JobView(**base)


def test_durations_and_rates_read_well() -> None:
    assert [duration(s) for s in (0, 42.4, 185, 3720, 2 * 86400 + 3 * 3600 + 5)] == [
        "0s", "42s", "3m05s", "1h02m", "2d03h"]
    assert duration(-5) == "0s"
    assert [throughput(v) for v in (0.5, 812.3, 12_345, 1_500_000)] == [
        "0.5 samples/s", "812 samples/s", "12.3k samples/s", "1.5M samples/s"]


def test_the_step_rate_comes_from_steps_seen_over_time_and_restarts_after_a_rollback() -> None:
    rate = StepRate()
    assert rate.steps_per_second() is None
    rate.observe(0.0, 10)
    rate.observe(0.5, 10)  # the same report again
    rate.observe(2.0, 30)
    assert rate.steps_per_second() == 10.0
    rate.observe(3.0, 5)  # back to a checkpoint
    assert rate.steps_per_second() is None
    rate.observe(4.0, 9)
    assert rate.steps_per_second() == 4.0
    rate.observe(5.0, None)
    assert rate.steps_per_second() == 4.0


def test_progress_has_what_was_reported_and_an_eta_only_with_a_total_and_a_rate() -> None:
    view = _view(last_step=250, total_steps=1000, samples_per_second=812.0, loss=2.3456,
                 last_checkpoint_at=NOW - timedelta(seconds=35))
    p = progress_of(view, now=NOW, steps_per_second=5.0)
    assert (p.step, p.total_steps, p.world_size, p.checkpoint_age_s, p.eta_s) == (
        250, 1000, 4, 35.0, 150.0)
    assert p.fraction == 0.25
    assert progress_line(p) == ("progress: step 250/1000, 812 samples/s, loss 2.346, "
                                "world size 4, checkpoint 35s ago, about 2m30s left")
    assert progress_of(view, now=NOW, steps_per_second=None).eta_s is None
    bare = progress_of(_view(), now=NOW, steps_per_second=None)
    assert progress_line(bare) == "progress: world size 4"
    assert progress_of(_view(world_size=0, phase=JobPhase.PENDING), now=NOW,
                       steps_per_second=None).shown is False


def test_the_bar_fills_with_the_fraction_and_fits_the_width() -> None:
    p = Progress(phase=JobPhase.RUNNING, world_size=2, step=500, total_steps=1000)
    bar = progress_bar(p, 80)
    assert bar.startswith("[" + "=" * 10 + ">" + " " * 9 + "]  50%  step 500/1000")
    assert progress_bar(Progress(phase=JobPhase.RUNNING, world_size=2, step=7), 80) == (
        "step 7 · world size 2")


@given(width=st.integers(min_value=1, max_value=300), step=st.integers(0, 10**9),
       total=st.one_of(st.none(), st.integers(1, 10**9)),
       rate=st.one_of(st.none(), st.floats(0, 1e9)), loss=st.one_of(st.none(), st.floats()))
def test_the_bar_never_wraps_a_terminal(width: int, step: int, total: int | None,
                                        rate: float | None, loss: float | None) -> None:
    p = Progress(phase=JobPhase.RUNNING, world_size=3, step=step, total_steps=total,
                 samples_per_second=rate, loss=loss, checkpoint_age_s=12.0, eta_s=99.0)
    assert len(progress_bar(p, width)) <= max(1, width - 1)
    assert "\n" not in progress_bar(p, width)


def test_plain_lines_come_first_on_resize_and_then_at_most_every_interval() -> None:
    a = Progress(phase=JobPhase.RUNNING, world_size=2, step=10)
    b = Progress(phase=JobPhase.RUNNING, world_size=2, step=20)
    grown = Progress(phase=JobPhase.RUNNING, world_size=4, step=20)
    nothing = Progress(phase=JobPhase.PENDING, world_size=0)
    assert should_print(a, None, since_last_s=0)
    assert not should_print(nothing, None, since_last_s=100)
    assert not should_print(b, a, since_last_s=3, every_s=10)
    assert should_print(b, a, since_last_s=10, every_s=10)
    assert not should_print(a, a, since_last_s=60, every_s=10)  # the step did not move
    assert should_print(grown, b, since_last_s=0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_console_redraws_a_bar_under_lines_on_a_terminal() -> None:
    out = io.StringIO()
    console = FollowConsole(out, tty=True, width=lambda: 60)
    p = Progress(phase=JobPhase.RUNNING, world_size=2, step=5, total_steps=10)
    console.progress(p)
    console.line("[a r0] hello")
    console.finish()
    bar = progress_bar(p, 60)
    assert out.getvalue() == ("\r\x1b[K" + bar + "\r\x1b[K[a r0] hello\n" + bar + "\r\x1b[K")


def test_the_console_prints_plain_lines_when_not_a_terminal() -> None:
    out, clock = io.StringIO(), _Clock()
    console = FollowConsole(out, tty=False, clock=clock)
    console.progress(Progress(phase=JobPhase.RUNNING, world_size=2, step=5))
    clock.now = 1.0
    console.progress(Progress(phase=JobPhase.RUNNING, world_size=2, step=6))  # too soon
    console.line("[a r0] hello")
    clock.now = 11.0
    console.progress(Progress(phase=JobPhase.RUNNING, world_size=2, step=9))
    console.finish()
    assert out.getvalue().splitlines() == [
        "progress: step 5, world size 2", "[a r0] hello", "progress: step 9, world size 2"]
    assert "\r" not in out.getvalue()


def test_log_lines_are_prefixed_and_parse_back() -> None:
    assert output_line("node-1", 3, "loss 2.0") == "[node-1 r3] loss 2.0"
    assert parse_log_line("[node-1 r3] loss [2.0] ") == {
        "node": "node-1", "rank": 3, "line": "loss [2.0] "}
    assert parse_log_line(tidal_line("node b is gone")) == {"tidal": "node b is gone"}
    assert parse_log_line("no prefix") == {"line": "no prefix"}


def test_the_nodes_of_a_job_are_those_assigned_reporting_or_named_by_an_event() -> None:
    record = JobRecord(job_id="t-0123abcd", spec=JobSpec(name="t", command=["x"]),
                       nodes={"c": 3})
    events = [JobEvent(seq=1, phase=JobPhase.RUNNING, reason=EventReason.SUBMITTED,
                       message="", nodes=["a", "b"])]
    assert nodes_of_job(record, [], events) == ["a", "b", "c"]
    assert nodes_of_job(record, [], []) == ["c"]


def test_the_api_shows_the_progress_of_the_nodes_in_force() -> None:
    from rendezvous.records import JobNodeState, JobNodeStatus
    from service.coordinator.views import progress_fields

    def status(node: str, **fields: Any) -> JobNodeStatus:
        return JobNodeStatus(job_id="t-0123abcd", node_id=node, state=JobNodeState.RUNNING,
                             **fields)

    a = status("a", samples_per_second=800.0, loss=2.0, total_steps=100,
               last_checkpoint_time=NOW.timestamp() - 10)
    b = status("b", samples_per_second=810.0, loss=3.0, last_checkpoint_time=NOW.timestamp())
    gone = status("c", samples_per_second=9999.0, loss=99.0,
                  last_checkpoint_time=NOW.timestamp() + 5)
    fields = progress_fields({"a": a, "b": b}, {"a": a, "b": b, "c": gone})
    assert fields == {"samples_per_second": 810.0, "loss": 2.5, "total_steps": 100,
                      "last_checkpoint_at": NOW + timedelta(seconds=5)}
    assert progress_fields({}, {}) == {"samples_per_second": None, "loss": None,
                                       "total_steps": None, "last_checkpoint_at": None}
