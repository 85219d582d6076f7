"""checkpoints.nccl: the stop signal reaches a thread at once, which aborts after its delay.

The abort itself needs NCCL (tests/integration/checkpoints/test_nccl_abort.py,
marker ``cuda``); here a callback stands for it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from checkpoints import nccl


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
