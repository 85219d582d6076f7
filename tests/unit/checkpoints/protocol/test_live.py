"""The live resize's files (checkpoints.protocol.live), the contract between the runner and
its workers: each reads back as written, a malformed, huge or symlinked one reads as absent,
and the workers' face (checkpoints.live) hands out the same names. That the runner reads
them without torch: tests/integration/test_imports.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import checkpoints.live
import checkpoints.protocol.live
from checkpoints.protocol.live import (
    LEAVE_NOTICE,
    LOST_NOTICE,
    RESIZE_NOTICE,
    LiveState,
    ResizeNotice,
    WorkerLive,
    clear_live_files,
    read_leave_notice,
    read_lost_notice,
    read_resize_notice,
    read_worker_live,
    worker_live_path,
    write_leave_notice,
    write_lost_notice,
    write_resize_notice,
    write_worker_live,
)


def notice(round_: int = 3, **changes: object) -> ResizeNotice:
    fields: dict[str, object] = dict(
        round=round_, master_addr="10.0.0.7", master_port=29500, world_size=4,
        ranks={0: 2, 1: 3}, written_at=1700000000.5,
    )
    fields.update(changes)
    return ResizeNotice(**fields)  # type: ignore[arg-type]



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


def test_a_resize_notice_after_a_lost_member_says_so_and_a_planned_one_does_not(
    tmp_path: Path,
) -> None:
    assert "lost" not in notice().to_json()
    write_resize_notice(tmp_path, notice(lost=True))
    assert read_resize_notice(tmp_path) == notice(lost=True)
    body = notice().to_json()
    body["lost"] = "yes"
    (tmp_path / RESIZE_NOTICE).write_text(json.dumps(body))
    assert read_resize_notice(tmp_path) is None


def test_a_lost_notice_reads_back_is_cleared_and_a_malformed_one_is_absent(
    tmp_path: Path,
) -> None:
    write_lost_notice(tmp_path, round_=4, now=12.5)
    got = read_lost_notice(tmp_path)
    assert got is not None and (got.round, got.written_at) == (4, 12.5)
    for bad in ("{}", '{"round": -1, "written_at": 1}', '{"round": 2, "written_at": true}',
                "nope"):
        (tmp_path / LOST_NOTICE).write_text(bad)
        assert read_lost_notice(tmp_path) is None
    clear_live_files(tmp_path)
    assert not os.listdir(tmp_path)


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




def test_the_workers_see_the_same_contract_the_runner_does() -> None:
    for name in checkpoints.protocol.live.__all__:
        if name != "read_small":
            assert getattr(checkpoints.live, name) is getattr(checkpoints.protocol.live, name), name
