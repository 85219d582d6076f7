"""Just-in-time save: when a peer dies, keep the last completed step instead of losing to it.

The ranks of a replicated (DDP) job hold identical model and optimizer state
after every optimizer step, and that state changes only inside
``optimizer.step()``. When a peer dies, the step in flight fails in a
collective (gloo raises once the dead peer's sockets close) or hangs in one
(a machine that vanished sends no reset), but the state of the last completed
step is still intact in every survivor's memory. :class:`JustInTimeSaver`
writes it then, so that the job loses at most the step in flight, whatever
``every_steps`` is.

**The step boundary.** :meth:`JustInTimeSaver.boundary` is called by
``Checkpointer.maybe_save(step)``, after the optimizer step: it records the
step and takes the small state (step, RNG, scheduler, extras) of that moment.
An optimizer step pre-hook marks the live state *dirty* as soon as the next
optimizer step begins; the save refuses dirty state (its parameters may be
half-updated, or a step ahead of the recorded one), so a failure between
``optimizer.step()`` and ``maybe_save`` costs the fallback to the periodic
checkpoint on that rank, never a wrong one. The model and optimizer tensors
are written live (no copy): the hook and the save share a lock, so an
optimizer step that would start while they are written waits.

**Triggers.** The failure surfaces as an exception that ends the worker: a
``sys.excepthook`` installed here saves before the interpreter exits, when the
exception looks like a failed collective (:func:`is_collective_failure`). A
worker blocked in a collective that never returns cannot run Python in its
main thread; the runner writes a *notice* (``<TIDAL_PROGRESS_DIR>/peer-lost``)
when it learns that a peer is gone, and a watcher thread saves from there.
Either way the save happens once.

**No consensus.** A broken group cannot agree on who writes. Every rank that
writes (local rank 0 of each node: one copy per node) commits its own
candidate ``jit-<step>-e<epoch>-r<rank>`` atomically (temporary directory,
fsync, manifest with CRC-32s, rename), never overwriting anyone's. Candidates
of one step are identical, so the next restore may take any valid one: the
newest step that verifies wins (:meth:`storage.CheckpointStore.candidates`).
A half-written candidate has no final name and is never seen; a mixed one
cannot exist, since every file comes from one process. Restore epochs fence
out late writers (:class:`storage.Fence`).

**Telling the runner** (the files are :mod:`checkpoints.protocol.jit`). While saving,
the rank keeps ``<TIDAL_PROGRESS_DIR>/saving-rank-<RANK>.json`` up to date (bytes written,
every 0.1 s): the runner waits for a worker stuck in a failed collective only
while that file shows progress, up to a bound (:func:`keep_waiting`).

Sharded (FSDP/DCP) state is not fully held by any one rank: no just-in-time
save there; the job falls back to its last periodic checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.errors import CheckpointError
from checkpoints.files import CheckpointFileWriter
from checkpoints.protocol import env as worker_env
from checkpoints.protocol.jit import (
    ARMED,
    DONE,
    FAILED,
    NOTICE_NAME,
    SAVING,
    SKIPPED,
    SavingReport,
    clear_reports,
    keep_waiting,
    read_reports,
    report_path,
    write_notice,
    write_report,
)
from checkpoints.state import write_replicated
from checkpoints.storage import CheckpointStore, jit_name

__all__ = [
    "JIT_ENV",
    "NOTICE_NAME",
    "JustInTimeSaver",
    "SavingReport",
    "clear_reports",
    "is_collective_failure",
    "keep_waiting",
    "read_reports",
    "write_notice",
]

log = logging.getLogger(__name__)

#: Set to "0" in a worker's environment to turn just-in-time saves off (benchmarks).
JIT_ENV = worker_env.JIT_SAVE
_POLL_S = 0.05
_BEAT_S = 0.1
_FAILURE_TEXT = re.compile(
    r"gloo|nccl|connection (closed|reset) by peer|broken pipe|timed out|timeout"
    r"|processgroup|collective|socket",
    re.IGNORECASE,
)

def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective that failed: a dead or lost peer."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if isinstance(current, RuntimeError | ConnectionError | TimeoutError) and (
            _FAILURE_TEXT.search(str(current))
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


class JustInTimeSaver:
    """Saves the last completed step when a collective fails or the runner says a peer is gone.

    Args:
        store: the checkpoint root.
        rank: this process's global rank.
        world_size: the job's world size.
        optimizer: the optimizer whose step marks the state dirty.
        small_state: returns the small state tree of a step (called at each boundary).
        large_state: returns the model and optimizer state (live tensors).
        epoch: this run's restore epoch (a property: restore sets it later).
        progress_dir: where the runner's notice and this rank's report live (None: no runner).
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        rank: int,
        world_size: int,
        optimizer: torch.optim.Optimizer,
        small_state: Callable[[int], dict[str, Any]],
        large_state: Callable[[], dict[str, Any]],
        epoch: Callable[[], int],
        progress_dir: Path | None,
    ) -> None:
        self._store, self._rank, self._world_size = store, rank, world_size
        self._small_state, self._large_state, self._epoch = small_state, large_state, epoch
        self._progress_dir = progress_dir
        self._lock = threading.Lock()  # the state is not changing while this is held
        self._step: int | None = None
        self._small: dict[str, Any] | None = None
        self._dirty = True  # nothing completed yet
        self._saved = threading.Event()
        self._started = False
        self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._previous_hook: Any = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._armed_at = time.time()
        self._writer: CheckpointFileWriter | None = None
        self.path: Path | None = None  # the candidate written, if any

    # ------------------------------------------------------------ the boundary

    def boundary(self, step: int) -> None:
        """``step`` optimizer steps are complete and nothing has changed since: remember it."""
        small = self._small_state(step)
        rng = small.pop("rng", None)  # fresh objects already: no copy
        small = copy.deepcopy(small)  # the scheduler's and the extras' values may change
        small["rng"] = rng
        with self._lock:
            self._step, self._small, self._dirty = step, small, False

    def _before_optimizer_step(self, *_: Any) -> None:
        with self._lock:
            self._dirty = True

    # ---------------------------------------------------------------- triggers

    def arm(self) -> None:
        """Start saving on a failed collective (excepthook) or the runner's notice (a thread)."""
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        # An exit while the watcher saves (the main thread's exception, handled
        # by someone else's code) waits for the save rather than cutting it off.
        atexit.register(self._finish_in_flight)
        if self._progress_dir is None:
            return
        self._report(ARMED)
        self._watcher = threading.Thread(target=self._watch, name="checkpoint-jit", daemon=True)
        self._watcher.start()

    def disarm(self) -> None:
        """Stop watching; remove the hooks (the checkpointer is closed)."""
        self._stop.set()
        self._hook.remove()
        atexit.unregister(self._finish_in_flight)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook or sys.__excepthook__
        if self._progress_dir is not None and not self._started:
            with contextlib.suppress(OSError):
                report_path(self._progress_dir, self._rank).unlink()

    def _finish_in_flight(self) -> None:
        if self._started:
            self._saved.wait()

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            if is_collective_failure(value):
                self.save(f"a collective failed ({kind.__name__})")
        finally:
            (self._previous_hook or sys.__excepthook__)(kind, value, tb)

    def _watch(self) -> None:
        assert self._progress_dir is not None
        notice = self._progress_dir / NOTICE_NAME
        while not self._stop.wait(_POLL_S):
            try:
                noticed = notice.stat().st_mtime >= self._armed_at - 1.0
            except OSError:
                continue
            if noticed:
                self.save("the runner says a peer is gone")
                return

    # -------------------------------------------------------------------- save

    def save(self, reason: str) -> Path | None:
        """Write the last completed step as this rank's candidate, once; wait if one is in flight.

        Returns:
            The candidate's path, or None when there was nothing safe to save
            (no completed step, or an optimizer step had begun) or it failed.
        """
        with self._lock:
            first = not self._started
            self._started = True
            if first:
                return self._save_locked(reason)
        self._saved.wait()
        return self.path

    def _save_locked(self, reason: str) -> Path | None:
        try:
            if self._step is None or self._small is None or self._dirty:
                why = ("no step completed yet" if self._step is None
                       else "an optimizer step had begun after the last completed step")
                log.warning("no just-in-time save (%s): %s", reason, why)
                self._report(SKIPPED, detail=why)
                return None
            step, started = self._step, time.monotonic()
            log.warning("just-in-time save of step %d: %s", step, reason)
            self._report(SAVING, step=step)
            beat = threading.Thread(target=self._beat, args=(step,), daemon=True)
            beat.start()
            tree = {**self._small, **self._large_state()}
            try:
                path, _ = write_replicated(
                    self._store, tree, step=step, world_size=self._world_size, started=started,
                    epoch=self._epoch(),
                    name=jit_name(step, epoch=self._epoch(), rank=self._rank),
                    on_open=self._on_open,
                )
            except (CheckpointError, OSError, RuntimeError) as exc:
                log.error("the just-in-time save of step %d failed: %s", step, exc)
                self._report(FAILED, step=step, detail=str(exc))
                return None
            finally:
                self._stop.set()
                beat.join(timeout=1.0)  # its last report must not land after ours
            self.path = path
            log.warning("just-in-time save of step %d committed to %s in %.2f s",
                        step, path, time.monotonic() - started)
            self._report(DONE, step=step, written=self._written())
            return path
        finally:
            self._saved.set()

    def _on_open(self, writer: CheckpointFileWriter) -> None:
        self._writer = writer

    def _written(self) -> int:
        return self._writer.size if self._writer is not None else 0

    def _beat(self, step: int) -> None:
        while not self._stop.wait(_BEAT_S):
            self._report(SAVING, step=step, written=self._written())

    def _report(self, state: str, *, step: int = -1, written: int = 0, detail: str = "") -> None:
        if self._progress_dir is None:
            return
        write_report(self._progress_dir, SavingReport(
            rank=self._rank, pid=os.getpid(), state=state, step=step, bytes=written,
            time=time.time(), detail=detail,
        ))
