"""A worker's end of the live resize's files (checkpoints.live.link): waiting for the notice
of a round on an injected clock, and the watch that reads a notice only when it changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints.live import (
    RESIZE_NOTICE,
    LiveResizeError,
    NoticeWatch,
    wait_for_notice,
    write_resize_notice,
)
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
