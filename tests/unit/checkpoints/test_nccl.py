"""checkpoints.nccl: the stop signal reaches a thread at once, which aborts after its delay.

The abort itself needs NCCL (tests/integration/checkpoints/test_nccl_abort.py,
marker ``cuda``); here a callback stands for it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpoints import nccl
from tests.support.wait import wait_for


@pytest.fixture
def sigterm_handled() -> Iterator[list[int]]:
    """A Python SIGTERM handler (as the checkpoints library installs), restored after."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGTERM, previous)


def test_a_stop_signal_aborts_after_the_delay(sigterm_handled: list[int]) -> None:
    aborted = threading.Event()
    watcher = nccl.abort_on_stop(abort=aborted.set, delay_s=0.05)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert aborted.wait(10), "the abort did not come"
        assert watcher.aborted.is_set()
    finally:
        watcher.close()
    assert sigterm_handled == [signal.SIGTERM]  # the Python handler ran as well


def test_closing_within_the_delay_cancels_the_abort(sigterm_handled: list[int]) -> None:
    aborted = threading.Event()
    watcher = nccl.abort_on_stop(abort=aborted.set, delay_s=30)
    os.kill(os.getpid(), signal.SIGTERM)
    watcher.close()
    assert not aborted.is_set()


def test_other_signals_do_not_abort() -> None:
    aborted = threading.Event()
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, _frame: seen.append(signum))
    watcher = nccl.abort_on_stop(abort=aborted.set, delay_s=0)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert not aborted.wait(0.2)
    finally:
        watcher.close()
        signal.signal(signal.SIGUSR2, previous)


def test_close_puts_back_the_previous_wakeup_fd() -> None:
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    nccl.abort_on_stop(abort=lambda: None).close()
    assert signal.set_wakeup_fd(before) == before


def test_without_a_nccl_group_the_default_abort_does_nothing() -> None:
    assert nccl.abort_default_group() is False


def test_prepare_environment_keeps_a_jobs_own_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nccl.ASYNC_ERROR_HANDLING, "3")
    nccl.prepare_environment()
    assert os.environ[nccl.ASYNC_ERROR_HANDLING] == "3"
    monkeypatch.delenv(nccl.ASYNC_ERROR_HANDLING)
    nccl.prepare_environment()
    assert os.environ[nccl.ASYNC_ERROR_HANDLING] == "1"


def test_without_a_nccl_group_there_is_none_to_abort_on_a_lost_member() -> None:
    assert nccl.default_nccl_group() is None  # no process group at all here


class _Group:
    """Stands for a NCCL process group: counts its aborts."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()


def test_a_lost_notice_aborts_the_recorded_nccl_group_once_and_never_after_it_is_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # checkpoints.live.unblock: the runner's live-lost.json aborts the NCCL group that was
    # current when the groups were last formed, so that a collective blocked on a lost
    # member raises; once the checkpointer abandons that group (handled), a later notice
    # aborts nothing until the next group is recorded.
    from checkpoints.live import unblock as unblock_module
    from checkpoints.protocol.live import write_lost_notice

    caplog.set_level(logging.WARNING, logger="checkpoints.live")
    first, second = _Group(), _Group()
    current = [first]
    monkeypatch.setattr(unblock_module, "default_nccl_group", lambda: current[0])
    watcher = unblock_module.Unblocker(tmp_path).start()
    try:
        watcher.record()
        write_lost_notice(tmp_path, round_=1, now=time.time() + 1)
        assert first.aborted.wait(5), "the lost notice did not abort the NCCL group"
        watcher.handled()  # the checkpointer abandons the group ...
        current[0] = second  # ... and a new one forms, not yet recorded
        write_lost_notice(tmp_path, round_=2, now=time.time() + 2)
        wait_for(lambda: any("member of round 2 is lost" in r.getMessage()
                             for r in caplog.records), timeout=5,
                 what="the watcher to act on the second notice")
        assert not second.aborted.is_set()  # nothing recorded: nothing aborted
        watcher.record()  # the new group recorded: a notice newer than the last aborts it
        write_lost_notice(tmp_path, round_=2, now=time.time() + 3)
        assert second.aborted.wait(5)
        assert (first.aborts, second.aborts) == (1, 1)
    finally:
        watcher.stop()
