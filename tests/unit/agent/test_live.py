"""The runner's side of a live resize: its files and its decisions (agent.live)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent import live
from agent.live import WorkerLive
from agent.runner import resize_reason

ALIVE = {101, 102}


def alive(pid: int) -> bool:
    return pid in ALIVE


def worker(pid: int, state: str = live.READY, round_: int = 0, step: int | None = 5) -> WorkerLive:
    return WorkerLive(pid=pid, round=round_, step=step, state=state)


def write_worker(directory: Path, local_rank: int, body: object) -> None:
    (directory / live.worker_file(local_rank)).write_text(json.dumps(body))


def test_the_workers_answers_are_read_by_local_rank_and_bad_ones_left_out(tmp_path: Path) -> None:
    write_worker(tmp_path, 0, {"pid": 101, "round": 2, "step": 40, "state": "resized"})
    write_worker(tmp_path, 1, {"pid": 102, "round": 0, "step": None, "state": "ready"})
    write_worker(tmp_path, 2, {"pid": 103, "round": 0, "step": 1, "state": "sleeping"})
    write_worker(tmp_path, 3, {"pid": True, "round": 0, "step": 1, "state": "ready"})
    (tmp_path / live.worker_file(4)).write_text("{half")
    (tmp_path / live.worker_file(5)).symlink_to(tmp_path / live.worker_file(0))
    (tmp_path / live.worker_file(6)).write_text(json.dumps(
        {"pid": 1, "round": 0, "step": 1, "state": "ready", "pad": "x" * 5000}))
    os.mkfifo(tmp_path / live.worker_file(7))
    write_worker(tmp_path, 8, ["not", "an", "object"])
    assert live.read_workers(tmp_path) == {
        0: worker(101, live.RESIZED, 2, 40), 1: worker(102, live.READY, 0, None),
    }
    assert live.read_workers(tmp_path / "missing") == {}


def test_the_notices_are_written_whole_and_cleared_with_the_answers(tmp_path: Path) -> None:
    live.write_resize_notice(tmp_path, round_=3, master_addr="10.0.0.1", master_port=2950,
                             world_size=4, ranks={1: 3, 0: 2}, now=12.5)
    body = json.loads((tmp_path / live.RESIZE_NOTICE).read_text())
    assert body == {"round": 3, "master_addr": "10.0.0.1", "master_port": 2950,
                    "world_size": 4, "ranks": {"0": 2, "1": 3}, "written_at": 12.5}
    live.write_leave_notice(tmp_path, now=13.0)
    assert json.loads((tmp_path / live.LEAVE_NOTICE).read_text()) == {"written_at": 13.0}
    write_worker(tmp_path, 0, {"pid": 101, "round": 0, "step": 1, "state": "ready"})
    (tmp_path / "rank-0.json").write_text("{}")  # a progress report: not the live path's
    live.clear_live_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json"]


def test_a_notice_is_not_written_through_a_planted_temporary_name(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / f".{live.LEAVE_NOTICE}.{os.getpid()}.tmp").symlink_to(target)
    live.write_leave_notice(tmp_path, now=1.0)
    assert target.read_text() == "keep"
    assert json.loads((tmp_path / live.LEAVE_NOTICE).read_text()) == {"written_at": 1.0}


def test_a_group_is_live_capable_only_when_every_local_worker_announced_it_alive() -> None:
    ready = {0: worker(101), 1: worker(102, live.RESIZED, 2)}
    assert live.blocker(ready, [0, 1], alive) is None
    assert live.blocker({0: worker(101)}, [0, 1], alive) == live.NOT_CAPABLE  # no file: no library
    assert live.blocker({**ready, 1: worker(999)}, [0, 1], alive) == live.NOT_CAPABLE  # a dead pid
    assert live.blocker({**ready, 1: worker(102, live.RESIZING)}, [0, 1], alive) is not None
    assert live.blocker({**ready, 1: worker(102, live.LEFT)}, [0, 1], alive) is not None
    assert live.blocker({}, [], alive) == live.NOT_CAPABLE


def outcome(workers: dict[int, WorkerLive], *, exited: bool = False, superseded: bool = False,
            now: float = 0.0) -> str:
    return live.resize_outcome(workers, [0, 1], 3, exited=exited, superseded=superseded,
                               now=now, deadline=10.0)


def test_a_live_resize_is_done_once_every_worker_resized_into_the_round() -> None:
    assert outcome({0: worker(101, live.RESIZED, 3), 1: worker(102, live.RESIZED, 4)}) == live.DONE
    assert outcome({0: worker(101, live.RESIZED, 3), 1: worker(102, live.RESIZING, 2)}) == (
        live.WAITING)
    assert outcome({0: worker(101, live.RESIZED, 3), 1: worker(102, live.RESIZED, 2)}) == (
        live.WAITING)  # resized into an older round: not this one yet
    assert outcome({0: worker(101, live.RESIZED, 3)}) == live.WAITING


def test_a_live_resize_falls_back_on_an_exit_another_change_or_its_deadline() -> None:
    pending = {0: worker(101, live.RESIZING, 2), 1: worker(102, live.READY)}
    assert outcome(pending, exited=True) == live.WORKER_EXITED
    assert outcome(pending, superseded=True) == live.MEMBERSHIP_CHANGED
    assert outcome(pending, now=10.0) == live.TIMEOUT
    assert outcome(pending, now=9.99) == live.WAITING
    done = {0: worker(101, live.RESIZED, 3), 1: worker(102, live.RESIZED, 3)}
    assert outcome(done, exited=True, now=11.0) == live.DONE  # the answers came first


def test_a_planned_leave_is_done_once_every_worker_left_and_exited() -> None:
    pids = {0: 101, 1: 102}

    def leave(workers: dict[int, WorkerLive], gone: set[int], now: float = 0.0) -> str:
        return live.leave_outcome(workers, pids, lambda pid: pid not in gone, now=now,
                                  deadline=5.0)

    left = {0: worker(101, live.LEFT), 1: worker(102, live.LEFT)}
    assert leave(left, {101, 102}) == live.DONE
    assert leave(left, {101}) == live.WAITING  # the other is on its way out
    assert leave({0: worker(101), 1: worker(102)}, set()) == live.WAITING
    assert leave({0: worker(101), 1: worker(102, live.LEFT)}, {101}) == live.WORKER_EXITED
    assert leave({0: worker(101), 1: worker(102)}, set(), now=5.0) == live.TIMEOUT


@given(st.dictionaries(st.integers(0, 3), st.sampled_from(
    [live.READY, live.RESIZING, live.RESIZED, live.LEFT]), max_size=4),
    st.booleans(), st.booleans(), st.floats(0, 20))
def test_a_live_resize_waits_only_before_its_deadline_and_only_while_nothing_went_wrong(
    states: dict[int, str], exited: bool, superseded: bool, now: float
) -> None:
    workers = {lr: worker(100 + lr, s, 3) for lr, s in states.items()}
    result = live.resize_outcome(workers, [0, 1, 2, 3], 3, exited=exited,
                                 superseded=superseded, now=now, deadline=10.0)
    assert result in (live.DONE, live.WAITING, *live.FALLBACK_CAUSES)
    if result == live.WAITING:
        assert not exited and not superseded and now < 10.0
    assert (result == live.DONE) == (
        len(states) == 4 and all(s == live.RESIZED for s in states.values()))


@pytest.mark.parametrize(("kind", "reason"), [
    ("waiting", "join"), ("leaving", "leave"), ("lost", "lost"), ("superseded", "lost"),
])
def test_a_change_kind_names_its_resize_reason(kind: str, reason: str) -> None:
    assert resize_reason(kind) == reason
