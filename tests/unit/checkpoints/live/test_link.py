"""A worker's end of the live resize's files (checkpoints.live.link): waiting for the notice
of a round on an injected clock, and the watch that reads a notice only when it changed."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch.distributed as dist

from checkpoints.live import (
    HOST_WAIT_S,
    RESIZE_NOTICE,
    LiveResizeError,
    NoticeWatch,
    WorkerLink,
    wait_for_notice,
    write_resize_notice,
)
from rendezvous.etcd.server import free_port
from tests.unit.checkpoints.protocol.test_live import notice


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


def test_the_new_rank_0_of_a_growing_group_opens_its_store_and_goes_once_a_joiner_waits(
    tmp_path: Path,
) -> None:
    port = free_port()
    clock = FakeClock()
    link = WorkerLink(tmp_path, local_rank=1, clock=clock)
    grows = notice(3, master_addr="127.0.0.1", master_port=port, world_size=3, ranks={1: 0})
    write_resize_notice(tmp_path, grows)
    assert link.flags(world_size=2) == (0, 3)  # hosts round 3; no joiner yet
    joiner = dist.TCPStore("127.0.0.1", port, is_master=False,  # it listens already
                           timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    joiner.set("a joiner's address", "x")  # what gloo puts before it waits for the others
    assert link.flags(world_size=2) == (3, 3)
    store = link.take_store(grows)
    assert store is not None and store.fits(grows)
    assert link.take_store(grows) is None  # handed over once


def test_a_rank_that_does_not_host_follows_the_host_or_acts_after_a_moment(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    link = WorkerLink(tmp_path, local_rank=0, clock=clock)
    write_resize_notice(tmp_path, notice(3, world_size=3, ranks={0: 1}))
    assert link.flags(world_size=2) == (0, 0)
    link.host_said = 3
    clock.now += HOST_WAIT_S
    assert link.flags(world_size=2) == (0, 0)  # the host decides
    link.host_said = 0
    assert link.flags(world_size=2) == (3, 0)  # nobody hosts it: a joiner does
    assert link.take_store(notice(3)) is None
