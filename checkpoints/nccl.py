"""NCCL workers that stop as fast as gloo ones when a peer dies.

A NCCL collective whose peer died blocks until the process group's timeout
(10 minutes by default): the main thread waits inside CUDA or NCCL, where no
Python signal handler runs, so the SIGTERM that tidal's runner (torch
elastic) sends every worker when a peer fails only acts once the timeout has
passed. gloo's collectives fail at once, because the peer's socket closes.

:func:`abort_on_stop` closes that gap. Python's C-level signal handler writes
each signal's number to a *wakeup fd* (:func:`signal.set_wakeup_fd`) at once,
whatever the main thread is doing; a daemon thread reading that fd aborts the
NCCL communicators ``delay_s`` after the stop signal arrives, unless the
worker is done with NCCL by then (:meth:`StopWatcher.close`). The blocked
collective then returns with an error, the main thread runs the Python
SIGTERM handler (a graceful or just-in-time save, :mod:`checkpoints.signals`;
its own consensus runs over gloo, which the abort leaves alone) and the worker
exits: recovery on GPUs no longer waits for a timeout.

Why a delay: the same SIGTERM also stops workers whose peers are all alive (a
drain, a scale-down), which finish the step in flight over NCCL before they
save. ``delay_s`` (2 s by default) lets a step of a healthy group end; a
group with a dead peer never ends it, and is aborted then.

:func:`prepare_environment` sets what makes NCCL surface errors rather than
hang (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); call it before
``init_process_group``. Under gloo, or outside tidal, both are harmless: the
abort is skipped where the default group is not NCCL.

Usage, in a training script::

    nccl.prepare_environment()
    dist.init_process_group("nccl", timeout=timedelta(seconds=60))
    stop = nccl.abort_on_stop()
    ...
    stop.close()  # optional: at exit, before destroy_process_group

Only one wakeup fd exists per process (asyncio uses it too): do not combine
with an asyncio loop in the main thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

#: What tidal's runner (torch elastic) sends workers it stops.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: NCCL's error handling: abort the communicator and raise on a failed or timed-out
#: collective instead of hanging (torch's default since 2.2 is 3: the same, no cleanup).
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def prepare_environment() -> None:
    """Make NCCL raise on a failed collective (unless the job chose otherwise).

    Call before ``init_process_group``: the process group reads it when created.
    """
    os.environ.setdefault(ASYNC_ERROR_HANDLING, "1")


def abort_default_group() -> bool:
    """Abort the default process group's communicators if it is NCCL's.

    Returns:
        True if a NCCL group was aborted.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    if dist.get_backend() != "nccl":
        return False
    from torch.distributed import distributed_c10d

    distributed_c10d._abort_process_group()
    return True


def default_nccl_group() -> Any | None:
    """The default process group if it has NCCL communicators, else None.

    For the live path (:class:`checkpoints.live.unblock.Unblocker`), which
    calls its ``abort()`` when a member is lost: the blocked collective raises
    at once, and the group stays registered with ``torch.distributed`` until
    the checkpointer's ``rejoin`` destroys it and makes the next one (unlike
    :func:`abort_default_group`, which unregisters every group). Subgroups
    are left alone (the checkpointer's own are gloo's).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    if "nccl" not in str(dist.get_backend()):
        return None
    return dist.group.WORLD


class StopWatcher:
    """A daemon thread that calls ``abort`` when one of ``signals`` arrives.

    Built by :func:`abort_on_stop`; :meth:`close` restores the previous wakeup fd.
    """

    def __init__(
        self, signals: Iterable[signal.Signals], abort: Callable[[], object], delay_s: float
    ) -> None:
        self._signals = {int(s) for s in signals}
        self._abort = abort
        self._delay = delay_s
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._closed = threading.Event()
        self.aborted = threading.Event()
        self._previous = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for sig in self._signals:
            # The wakeup fd is written only for signals with a Python handler; one
            # left at SIG_DFL ends the process anyway, so nothing would hang.
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                log.debug("signal %d has no Python handler: it ends the process itself", sig)
        self._thread = threading.Thread(target=self._run, name="nccl abort on stop",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if self._signals & set(data) and not self.aborted.is_set():
                if self._closed.wait(self._delay):
                    return  # the worker finished with NCCL meanwhile
                self.aborted.set()
                try:
                    self._abort()
                except Exception:  # the main thread's own error says more
                    log.exception("could not abort the process group")

    def close(self) -> None:
        """Stop watching; the previous wakeup fd (if any) is put back."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(ValueError):  # not the main thread: leave it
            signal.set_wakeup_fd(self._previous)
        self._write.close()
        with contextlib.suppress(OSError):
            self._read.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=1)
        self._read.close()


def abort_on_stop(
    signals: Iterable[signal.Signals] = STOP_SIGNALS,
    *,
    abort: Callable[[], object] = abort_default_group,
    delay_s: float = 2.0,
) -> StopWatcher:
    """Abort NCCL as soon as a stop signal arrives, even while a collective blocks.

    Call from the main thread, after the signal handlers are installed (the
    checkpoints library's SIGTERM handler) and after ``init_process_group``.

    Args:
        signals: the signals that mean "stop now".
        abort: what to do then (default: abort the default group if it is NCCL's).
        delay_s: how long after the signal the abort comes, unless :meth:`StopWatcher.close`
            was called meanwhile (a healthy group's step in flight ends in that time).

    Returns:
        The started watcher.

    Raises:
        ValueError: not called from the main thread.
    """
    return StopWatcher(signals, abort, delay_s)
