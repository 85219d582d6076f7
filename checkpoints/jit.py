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

**Triggers** (:class:`JustInTimeTrigger`, shared with the frameworks' savers in
:mod:`checkpoints.frameworks`, which differ only in what they save and how). The
failure surfaces as an exception that ends the worker: a ``sys.excepthook``
saves before the interpreter exits, when the exception looks like a failed
collective (:func:`is_collective_failure`). A worker blocked in a collective
that never returns cannot run Python in its main thread; the runner writes a
*notice* (``<TIDAL_PROGRESS_DIR>/peer-lost``) when it learns that a peer is gone,
and a watcher thread saves from there; a notice that lands while an optimizer step
runs waits for that step's boundary (:data:`BOUNDARY_WAIT_S`, bounded) and saves
it, rather than refusing. Either way the save happens once.

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

:class:`JustInTimeTrigger` is the machinery every just-in-time saver shares: the
dirty flag (an optimizer step pre-hook; the hook and the save share a lock), the
excepthook (optionally ending the process at once after its save: the
interpreter's teardown of a broken group can block up to the collective
timeout), the runner's notice and its watcher thread, the ``atexit`` wait for a
save in flight, the save-once guard and the reports. A subclass says which step
is safe to save and writes it; :class:`JustInTimeSaver` writes a candidate.
"""

from __future__ import annotations

import abc
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
    "JustInTimeTrigger",
    "SavingReport",
    "clear_reports",
    "is_collective_failure",
    "keep_waiting",
    "read_reports",
    "write_notice",
    "write_report",
]

log = logging.getLogger(__name__)

#: Set to "0" in a worker's environment to turn just-in-time saves off (benchmarks).
JIT_ENV = worker_env.JIT_SAVE
_POLL_S = 0.05
#: On the runner's notice, how long a save waits for the step boundary when an optimizer
#: step has begun: that step is local (the collective that failed, or will, is in the next
#: backward), so the boundary comes at once, and the state then is a whole step newer.
#: Below the runner's wait for an armed worker to start saving (agent.runner JIT_ACK_S).
BOUNDARY_WAIT_S = 0.35
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


class JustInTimeTrigger(abc.ABC):
    """Saves once, on a failed collective or the runner's notice; subclasses say what and how.

    The contract for a subclass:

    * its ``boundary`` calls :meth:`_record` with the completed step and the small
      state of that moment (copied: nothing may change it afterwards);
    * :meth:`_write` writes the recorded step and returns where it went, or None
      after reporting why it wrote nothing (it runs with the lock held, once);
      the exceptions in :attr:`_write_errors` it raises are logged and reported
      as a failed save, never raised to the trigger;
    * :meth:`_choose_step` may refuse more than a dirty or missing step.

    Args:
        optimizer: the torch optimizer whose step marks the state dirty (or a
            sequence of them: any one's step does; an empty one: the subclass's
            caller calls :meth:`mark_dirty` itself).
        rank: this process's global rank (for the runner's report).
        progress_dir: where the runner's notice and this rank's report live (None: no runner).
        exit_at_once: after the excepthook's save, end the process at once
            (``os._exit(1)``), skipping the interpreter's teardown of the broken group.
        thread_name: the watcher thread's name.
    """

    #: What :meth:`_write` may raise for a save that failed (logged and reported).
    _write_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(
        self,
        *,
        optimizer: Any,
        rank: int,
        progress_dir: Path | None,
        exit_at_once: bool = False,
        thread_name: str = "checkpoint-jit",
    ) -> None:
        self._rank, self._progress_dir = rank, progress_dir
        self._exit_at_once, self._thread_name = exit_at_once, thread_name
        self._lock = threading.Lock()  # the state is not changing while this is held
        self._boundary = threading.Condition(self._lock)  # notified by every _record
        self._step: int | None = None
        self._small: dict[str, Any] = {}
        self._dirty = True  # nothing completed yet
        self._started = False
        self._saved = threading.Event()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._previous_hook: Any = None
        optimizers = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        self._hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in optimizers]
        self._armed_at = time.time()
        self._save_started = 0.0  # time.monotonic() when the save began
        #: Where the save went, if it did.
        self.path: Path | None = None

    # ------------------------------------------------------------ the boundary

    def _record(self, step: int, small: dict[str, Any]) -> None:
        """``step`` optimizer steps are complete; ``small`` is what changes in the next one."""
        with self._lock:
            self._step, self._small, self._dirty = step, small, False
            self._boundary.notify_all()

    def mark_dirty(self) -> None:
        """The live state is about to change (an optimizer step begins): waits for a save."""
        with self._lock:
            self._dirty = True

    def _before_optimizer_step(self, *_: Any) -> None:
        self.mark_dirty()

    # ---------------------------------------------------------------- triggers

    def arm(self) -> None:
        """Save on a failed collective (excepthook) or the runner's notice (a thread)."""
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        # An exit while the watcher saves (the main thread's exception, handled
        # by someone else's code) waits for the save rather than cutting it off.
        atexit.register(self._finish_in_flight)
        if self._progress_dir is None:
            return
        self._report(ARMED)
        self._watcher = threading.Thread(target=self._watch, name=self._thread_name, daemon=True)
        self._watcher.start()

    def disarm(self) -> None:
        """Stop watching; remove the hooks (training ended or stopped cleanly)."""
        self._stop.set()
        for hook in self._hooks:
            hook.remove()
        atexit.unregister(self._finish_in_flight)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook or sys.__excepthook__
        if self._progress_dir is not None and not self._started:
            with contextlib.suppress(OSError):
                report_path(self._progress_dir, self._rank).unlink()

    def save_if_collective_failure(self, exc: BaseException) -> Path | None:
        """For code that catches the training's exception: save if it is a failed collective."""
        if is_collective_failure(exc):
            return self.save(f"a collective failed ({type(exc).__name__})")
        return None

    def _finish_in_flight(self) -> None:
        if self._started:
            self._saved.wait()

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        failed = False
        try:
            failed = is_collective_failure(value)
            if failed:
                self.save(f"a collective failed ({kind.__name__})")
        finally:
            (self._previous_hook or sys.__excepthook__)(kind, value, tb)
        if failed and self._exit_at_once:
            # The group is broken, but DDP's other buckets may still wait on a live
            # survivor: tearing the group down at interpreter exit would block in
            # its destructor up to the collective timeout (gloo's default: 30 min).
            # Leave now, with the exit code of an uncaught exception.
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)

    def _watch(self) -> None:
        assert self._progress_dir is not None
        notice = self._progress_dir / NOTICE_NAME
        while not self._stop.wait(_POLL_S):
            try:
                noticed = notice.stat().st_mtime >= self._armed_at - 1.0
            except OSError:
                continue
            if noticed:
                self.save("the runner says a peer is gone", boundary_wait_s=BOUNDARY_WAIT_S)
                return

    # -------------------------------------------------------------------- save

    def save(self, reason: str, *, boundary_wait_s: float = 0.0) -> Path | None:
        """Write the last completed step, once; wait if a save is in flight.

        Args:
            reason: why (logged).
            boundary_wait_s: when an optimizer step has begun, wait up to this long for
                its boundary and save that step (the runner's notice: the main thread is
                alive and finishing the step); 0: refuse at once (the excepthook: the
                main thread is gone).

        Returns:
            Where it went, or None when there was nothing safe to save (no
            completed step, or an optimizer step had begun), the subclass wrote
            nothing, or the save failed.
        """
        with self._lock:  # an optimizer step that would begin now waits for the save
            if boundary_wait_s > 0 and not self._started:
                self._boundary.wait_for(lambda: not self._dirty or self._started,
                                        timeout=boundary_wait_s)
            first = not self._started
            self._started = True
            self._boundary.notify_all()  # a save waiting for the boundary: this one goes
            if first:
                return self._save_locked(reason)
        self._saved.wait()
        return self.path

    def _choose_step(self) -> tuple[int | None, str]:
        """The step safe to save now, or None and why not (called with the lock held)."""
        if self._step is None:
            return None, "no step completed yet"
        if self._dirty:
            return None, "an optimizer step had begun after the last completed step"
        return self._step, ""

    @abc.abstractmethod
    def _write(self, step: int, reason: str) -> Path | None:
        """Write ``step`` (the lock is held); None: nothing written, and reported why."""

    def _written(self) -> int:
        """Bytes written so far (the runner waits while this grows)."""
        return 0

    def _committed(self, step: int, path: Path, seconds: float) -> None:
        log.warning("just-in-time save of step %d committed to %s in %.2f s", step, path, seconds)

    def _save_locked(self, reason: str) -> Path | None:
        try:
            step, why = self._choose_step()
            if step is None:
                log.warning("no just-in-time save (%s): %s", reason, why)
                self._report(SKIPPED, detail=why)
                return None
            started = self._save_started = time.monotonic()
            self._report(SAVING, step=step)
            beat = threading.Thread(target=self._beat, args=(step,), daemon=True)
            beat.start()
            try:
                path = self._write(step, reason)
            except self._write_errors as exc:  # the process is ending: say why, go on
                log.error("the just-in-time save of step %d failed: %s", step, exc)
                self._report(FAILED, step=step, detail=str(exc)[:500])
                return None
            finally:
                self._stop.set()
                beat.join(timeout=1.0)  # its last report must not land after ours
            if path is None:
                return None
            self.path = path
            self._committed(step, path, time.monotonic() - started)
            self._report(DONE, step=step, written=self._written())
            return path
        finally:
            self._saved.set()

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


class JustInTimeSaver(JustInTimeTrigger):
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

    _write_errors = (CheckpointError, OSError, RuntimeError)

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
        super().__init__(optimizer=optimizer, rank=rank, progress_dir=progress_dir)
        self._store, self._world_size = store, world_size
        self._small_state, self._large_state, self._epoch = small_state, large_state, epoch
        self._writer: CheckpointFileWriter | None = None

    def boundary(self, step: int) -> None:
        """``step`` optimizer steps are complete and nothing has changed since: remember it."""
        small = self._small_state(step)
        rng = small.pop("rng", None)  # fresh objects already: no copy
        small = copy.deepcopy(small)  # the scheduler's and the extras' values may change
        small["rng"] = rng
        self._record(step, small)

    def _write(self, step: int, reason: str) -> Path:
        log.warning("just-in-time save of step %d: %s", step, reason)
        tree = {**self._small, **self._large_state()}
        path, _ = write_replicated(
            self._store, tree, step=step, world_size=self._world_size, started=self._save_started,
            epoch=self._epoch(), name=jit_name(step, epoch=self._epoch(), rank=self._rank),
            on_open=self._on_open,
        )
        return path

    def _on_open(self, writer: CheckpointFileWriter) -> None:
        self._writer = writer

    def _written(self) -> int:
        return self._writer.size if self._writer is not None else 0
