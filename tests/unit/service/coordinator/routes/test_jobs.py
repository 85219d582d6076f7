"""The API's job rules as plain functions (service.coordinator.routes.jobs): what a scale,
a cancel and a submit change in a record, and what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.api.models import EventReason, JobPhase, JobSpec, ScaleRequest
from service.coordinator.routes.common import HttpError
from service.coordinator.routes.jobs import new_record, request_cancel, rescale
from service.coordinator.store import StateConflictError
from tests.unit.service.sim import make_job


def test_new_bounds_change_the_spec_and_write_one_event() -> None:
    record = make_job("j", min_nodes=1, max_nodes=2)
    [event] = rescale(record, ScaleRequest(max_nodes=4))
    assert (record.spec.min_nodes, record.spec.max_nodes) == (1, 4)
    assert (event.seq, event.reason, event.message) == (
        1, EventReason.SCALED_BY_USER, "bounds set to 1..4 node(s)")
    assert record.next_event == 2


def test_the_same_bounds_change_nothing() -> None:
    record = make_job("j", min_nodes=1, max_nodes=2)
    assert rescale(record, ScaleRequest(min_nodes=1)) == []
    assert record.next_event == 1


@pytest.mark.parametrize("phase", [JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED])
def test_an_ended_job_is_neither_scaled_nor_cancelled(phase: JobPhase) -> None:
    record = make_job("j")
    record.phase = phase
    with pytest.raises(StateConflictError, match=f"job j is {phase.value}; it cannot be scaled"):
        rescale(record, ScaleRequest(max_nodes=3))
    with pytest.raises(StateConflictError, match=f"already {phase.value}"):
        request_cancel(record)


def test_a_job_being_cancelled_is_not_scaled_and_a_cancel_is_recorded_once() -> None:
    record = make_job("j")
    assert request_cancel(record) == [] and record.cancel_requested
    with pytest.raises(StateConflictError, match="being cancelled"):
        rescale(record, ScaleRequest(max_nodes=3))


@given(old=st.tuples(st.integers(1, 8), st.integers(0, 8)),
       new=st.tuples(st.none() | st.integers(1, 16), st.none() | st.integers(1, 16)).filter(
           lambda n: n != (None, None)))  # ScaleRequest itself refuses an empty change
def test_bounds_are_kept_valid_or_refused_with_422(
    old: tuple[int, int], new: tuple[int | None, int | None]
) -> None:
    record = make_job("j", min_nodes=old[0], max_nodes=old[0] + old[1])
    before = record.spec
    want_min = new[0] if new[0] is not None else before.min_nodes
    want_max = new[1] if new[1] is not None else before.max_nodes
    try:
        rescale(record, ScaleRequest(min_nodes=new[0], max_nodes=new[1]))
    except HttpError as exc:
        assert exc.status == 422 and want_min > want_max
        assert record.spec == before
        return
    assert (record.spec.min_nodes, record.spec.max_nodes) == (want_min, want_max)


def test_a_submitted_job_gets_its_directories_under_the_roots_or_a_422(tmp_path: Path) -> None:
    spec = JobSpec(name="train", command=["python", "t.py"], working_dir="w",
                   checkpoint_dir="c")
    record, event = new_record(spec, workdir_root=tmp_path / "work",
                               checkpoint_root=tmp_path / "ckpt")
    assert record.cwd == str(tmp_path / "work" / "w")
    assert record.checkpoint_path == str(tmp_path / "ckpt" / "c")
    assert (event.seq, event.reason, record.next_event) == (0, EventReason.SUBMITTED, 1)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "out").symlink_to(tmp_path)
    escaping = spec.model_copy(update={"working_dir": "out/elsewhere"})
    with pytest.raises(HttpError, match=r"working_dir .* resolves outside the allowed root"):
        new_record(escaping, workdir_root=tmp_path / "work", checkpoint_root=tmp_path / "ckpt")
