"""The live resize's pure parts: its files, the sync source, the decision at a boundary."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from checkpoints.live import (
    LEAVE_NOTICE,
    RESIZE_NOTICE,
    Action,
    LiveResizeError,
    LiveState,
    NoticeWatch,
    ResizeNotice,
    WorkerLive,
    choose_source,
    clear_live_files,
    decide,
    pending_round,
    read_leave_notice,
    read_resize_notice,
    read_worker_live,
    sync_state,
    wait_for_notice,
    worker_live_path,
    write_leave_notice,
    write_resize_notice,
    write_worker_live,
)
from checkpoints.live.sync import _fill, _slots, _split
from checkpoints.progress import FileProgressReporter, NullProgressReporter


def notice(round_: int = 3, **changes: object) -> ResizeNotice:
    fields: dict[str, object] = dict(
        round=round_, master_addr="10.0.0.7", master_port=29500, world_size=4,
        ranks={0: 2, 1: 3}, written_at=1700000000.5,
    )
    fields.update(changes)
    return ResizeNotice(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the files


def test_a_resize_notice_reads_back_as_written_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_resize_notice(tmp_path, notice(group_rank=1, group_world_size=2))
    assert read_resize_notice(tmp_path) == notice(group_rank=1, group_world_size=2)
    assert os.listdir(tmp_path) == [RESIZE_NOTICE]
    body = json.loads((tmp_path / RESIZE_NOTICE).read_text())
    assert body["ranks"] == {"0": 2, "1": 3}  # local ranks are JSON object keys


def test_a_newer_resize_notice_replaces_the_older_one(tmp_path: Path) -> None:
    write_resize_notice(tmp_path, notice(3))
    write_resize_notice(tmp_path, notice(4, master_port=29600))
    got = read_resize_notice(tmp_path)
    assert got is not None and (got.round, got.master_port) == (4, 29600)


def test_group_rank_is_optional_in_a_resize_notice(tmp_path: Path) -> None:
    body = notice().to_json()
    assert "group_rank" not in body and "group_world_size" not in body
    (tmp_path / RESIZE_NOTICE).write_text(json.dumps(body))
    got = read_resize_notice(tmp_path)
    assert got is not None and got.group_rank is None


@pytest.mark.parametrize(
    "body",
    [
        "",
        "{",
        "[]",
        '"round"',
        json.dumps({**notice().to_json(), "round": 0}),
        json.dumps({**notice().to_json(), "round": "3"}),
        json.dumps({**notice().to_json(), "round": True}),
        json.dumps({**notice().to_json(), "world_size": 0}),
        json.dumps({**notice().to_json(), "ranks": {}}),
        json.dumps({**notice().to_json(), "ranks": {"x": 0}}),
        json.dumps({**notice().to_json(), "ranks": {"0": 4}}),  # outside the world size
        json.dumps({**notice().to_json(), "ranks": {"0": -1}}),
        json.dumps({**notice().to_json(), "master_addr": ""}),
        json.dumps({**notice().to_json(), "master_port": 70000}),
        json.dumps({**notice().to_json(), "written_at": "now"}),
        json.dumps({k: v for k, v in notice().to_json().items() if k != "master_port"}),
    ],
)
def test_a_malformed_resize_notice_reads_as_none(tmp_path: Path, body: str) -> None:
    (tmp_path / RESIZE_NOTICE).write_text(body)
    assert read_resize_notice(tmp_path) is None


def test_a_missing_notice_reads_as_none(tmp_path: Path) -> None:
    assert read_resize_notice(tmp_path) is None
    assert read_leave_notice(tmp_path) is None
    assert read_worker_live(tmp_path, 0) is None
    assert read_resize_notice(tmp_path / "not-there") is None


def test_notices_are_not_read_through_a_symlink_or_when_huge(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(notice().to_json()))
    (tmp_path / RESIZE_NOTICE).symlink_to(elsewhere)
    assert read_resize_notice(tmp_path) is None
    (tmp_path / LEAVE_NOTICE).write_text(json.dumps({"written_at": 1.0, "pad": "x" * 5000}))
    assert read_leave_notice(tmp_path) is None


def test_a_write_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    (tmp_path / LEAVE_NOTICE).symlink_to(target)
    write_leave_notice(tmp_path, now=5.0)
    assert target.read_text() == "keep"
    assert read_leave_notice(tmp_path) is not None


def test_a_leave_notice_reads_back_and_a_malformed_one_is_absent(tmp_path: Path) -> None:
    write_leave_notice(tmp_path, now=12.5)
    got = read_leave_notice(tmp_path)
    assert got is not None and got.written_at == 12.5
    for bad in ("{}", '{"written_at": "soon"}', "[1]", "nope"):
        (tmp_path / LEAVE_NOTICE).write_text(bad)
        assert read_leave_notice(tmp_path) is None


def test_a_workers_live_file_reads_back_as_written(tmp_path: Path) -> None:
    for live in (
        WorkerLive(pid=123, round=0, step=None, state=LiveState.READY),
        WorkerLive(pid=123, round=2, step=40, state=LiveState.RESIZED),
    ):
        write_worker_live(tmp_path, 1, live)
        assert read_worker_live(tmp_path, 1) == live
    assert worker_live_path(tmp_path, 1).name == "live-1.json"
    assert read_worker_live(tmp_path, 0) is None


@pytest.mark.parametrize(
    "body",
    [
        {"pid": 1, "round": 0, "step": None, "state": "sleeping"},
        {"pid": 0, "round": 0, "step": None, "state": "ready"},
        {"pid": 1, "round": -1, "step": None, "state": "ready"},
        {"pid": 1, "round": 0, "step": "3", "state": "ready"},
        {"round": 0, "step": None, "state": "ready"},
        [1, 2],
    ],
)
def test_a_malformed_workers_live_file_reads_as_none(tmp_path: Path, body: object) -> None:
    worker_live_path(tmp_path, 0).write_text(json.dumps(body))
    assert read_worker_live(tmp_path, 0) is None


def test_clearing_removes_the_notices_and_the_workers_files_only(tmp_path: Path) -> None:
    write_resize_notice(tmp_path, notice())
    write_leave_notice(tmp_path)
    for local_rank in (0, 1, 12):
        write_worker_live(tmp_path, local_rank, WorkerLive(1, 0, None, LiveState.READY))
    keep = ["rank-0.json", "saving-rank-0.json", "live-x.json", "peer-lost", "live-1.json.bak"]
    for name in keep:
        (tmp_path / name).write_text("{}")
    clear_live_files(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(keep)
    clear_live_files(tmp_path / "missing")  # nothing to clear: no error


def test_only_leaving_is_terminal() -> None:
    assert [s for s in LiveState if s.is_terminal()] == [LiveState.LEFT]


# ---------------------------------------------------------------- the decisions


def test_the_source_is_the_lowest_rank_with_the_largest_step() -> None:
    assert choose_source([5, 5, -1]) == (0, 5)
    assert choose_source([-1, 7, 7]) == (1, 7)
    assert choose_source([-1, -1]) == (0, -1)  # nobody holds anything live
    assert choose_source([3]) == (0, 3)
    with pytest.raises(ValueError, match="no ranks"):
        choose_source([])


@given(st.lists(st.integers(min_value=-1, max_value=10**6), min_size=1, max_size=64))
def test_no_rank_before_the_source_holds_its_step_and_none_holds_more(steps: list[int]) -> None:
    source, step = choose_source(steps)
    assert steps[source] == step == max(steps)
    assert all(s < step for s in steps[:source])


def test_a_rank_flags_its_notice_until_it_acted_on_it() -> None:
    assert pending_round(None, 0) == 0
    assert pending_round(notice(3), 0) == 3
    assert pending_round(notice(3), 2) == 3
    assert pending_round(notice(3), 3) == 0  # resized into it already
    assert pending_round(notice(3), 4) == 0


@pytest.mark.parametrize(
    ("agreed", "current", "leaving", "notice_round", "action"),
    [
        (0, 0, False, None, Action.CONTINUE),  # nobody saw a notice
        (3, 3, False, 3, Action.CONTINUE),  # that round is this rank's already
        (2, 3, True, None, Action.CONTINUE),  # an older round: nothing to do
        (3, 0, False, 3, Action.RESIZE),
        (3, 2, False, 2, Action.RESIZE),  # its own notice is on its way
        (3, 2, False, None, Action.RESIZE),
        (4, 2, False, 5, Action.RESIZE),  # a newer notice already: take it
        (3, 2, True, None, Action.LEAVE),  # the node leaves: not in the new round
        (3, 2, True, 2, Action.LEAVE),  # an old notice does not keep it
        (3, 2, True, 3, Action.RESIZE),  # a notice of the round: it stays after all
    ],
)
def test_the_decision_at_a_boundary(
    agreed: int, current: int, leaving: bool, notice_round: int | None, action: Action
) -> None:
    got = decide(
        agreed_round=agreed, current_round=current, leaving=leaving, notice_round=notice_round
    )
    assert got is action


# ----------------------------------------------------------- waiting and watching


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.on_sleep: list[object] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep:
            action = self.on_sleep.pop(0)
            if callable(action):
                action()


def test_waiting_for_a_notice_returns_it_once_its_round_is_there(tmp_path: Path) -> None:
    write_resize_notice(tmp_path, notice(2))
    clock = FakeClock()
    clock.on_sleep = [None, lambda: write_resize_notice(tmp_path, notice(4))]
    got = wait_for_notice(tmp_path, min_round=3, timeout=30, clock=clock, sleep=clock.sleep)
    assert got.round == 4  # the newest, at least the agreed round
    assert clock.now < 100.1


def test_waiting_for_a_notice_that_never_comes_says_which_round_and_what_it_saw(
    tmp_path: Path,
) -> None:
    write_resize_notice(tmp_path, notice(2))
    clock = FakeClock()
    with pytest.raises(LiveResizeError, match=r"round 3 or later .*newest: round 2"):
        wait_for_notice(tmp_path, min_round=3, timeout=5, clock=clock, sleep=clock.sleep)
    assert 105.0 <= clock.now < 105.1


def test_the_watch_sees_a_new_notice_and_its_removal(tmp_path: Path) -> None:
    watch = NoticeWatch(tmp_path)
    assert watch.current() is None
    write_resize_notice(tmp_path, notice(1))
    first = watch.current()
    assert first is not None and first.round == 1
    assert watch.current() is first  # unchanged: not read again
    write_resize_notice(tmp_path, notice(2))
    second = watch.current()
    assert second is not None and second.round == 2
    (tmp_path / RESIZE_NOTICE).unlink()
    assert watch.current() is None


# --------------------------------------------------------------- the state sync


class Pair(NamedTuple):
    a: Any
    b: Any


def test_a_state_splits_into_a_plain_skeleton_and_its_tensors_and_back() -> None:
    state: dict[str, Any] = {
        "step": 7,
        "rng": {"torch": torch.arange(5, dtype=torch.uint8), "python": (3, (1, 2), None)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2, 3).t()}}, "param_groups": [{}]},
        "extra": [Pair(torch.tensor(1.5), "x")],
    }
    tensors: list[torch.Tensor] = []
    skeleton = _split(state, tensors)
    assert len(tensors) == 3 and all(t.is_contiguous() for t in tensors)
    assert [slot.shape for slot in _slots(skeleton)] == [(5,), (3, 2), ()]
    skeleton = pickle.loads(pickle.dumps(skeleton))  # what broadcast_object_list does
    back = _fill(skeleton, [t.clone() for t in tensors])
    assert back["step"] == 7 and back["rng"]["python"] == (3, (1, 2), None)
    assert isinstance(back["extra"][0], Pair) and back["extra"][0].b == "x"
    torch.testing.assert_close(back["optimizer"]["state"][0]["exp_avg"], torch.ones(3, 2))
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])


def test_a_single_rank_keeps_its_own_state() -> None:
    def capture() -> dict[str, Any]:
        raise AssertionError("nothing is sent with a single rank")

    got = sync_state(live_step=4, group=None, model=torch.nn.Linear(2, 2), capture=capture)
    assert (got.step, got.state) == (4, None)


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
