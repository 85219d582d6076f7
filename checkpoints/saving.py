"""One rank's saves under way: snapshot, write in the background, commit, report once.

The :class:`~checkpoints.checkpointer.Checkpointer` decides *when* to save
(its schedule, the skip-or-wait policy, the stop); a :class:`Saves` carries a
save out: it takes the snapshots (model and optimizer apart from the small
rest, so that the layout prepared ahead of the first save is the one taken),
hands the write to its :class:`~checkpoints.async_save.BackgroundWriter`, and
reports each finished save once, on the training thread. Replicated state is
written by rank 0 through :func:`~checkpoints.state.write_replicated`; sharded
state by every rank through DCP (:mod:`checkpoints.sharded`), rank 0
committing it with the small rest.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints import sharded as sharded_io
from checkpoints.async_save import BackgroundWriter, StateSnapshot, run_in_background
from checkpoints.errors import CheckpointError, CheckpointStateError, CheckpointWriteError
from checkpoints.files import use_direct_io
from checkpoints.progress import ProgressReporter
from checkpoints.state import write_replicated
from checkpoints.storage import CheckpointStore, Manifest

__all__ = ["SaveRecord", "Saves"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SaveRecord:
    """One save as this rank saw it (``save_seconds`` is None while in flight).

    ``stall_seconds`` is how long the save held the training loop up: the
    snapshot. On the side-stream path (state on a GPU) it is the time to queue
    the copy; what the next optimizer step waits for it on the device is not
    in it (it shows in the step time).

    ``writer_user_seconds`` and ``writer_system_seconds`` are the CPU time the
    writer thread spent on the save (serializing, checksumming, the kernel's
    share of writing): on a machine with few cores, what training may lose to
    it. None while in flight, and off Linux. A sharded save's shards are
    written by DCP's own threads and are not counted.
    """

    step: int
    stall_seconds: float
    save_seconds: float | None = None
    path: Path | None = None
    error: str | None = None
    writer_user_seconds: float | None = None
    writer_system_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Where:
    """What a save is written as: its step, world size and restore epoch, when it began."""

    step: int
    world_size: int
    epoch: int
    started: float


class Saves:
    """Takes snapshots and writes them in the background, one save at a time.

    Args:
        store: the checkpoint root.
        model: the model (its parameters are copied as they are on a GPU).
        optimizer: its optimizer: on a GPU, the snapshot's copy runs on a side
            stream and the optimizer's next step is ordered after it.
        keep: how many checkpoints to keep.
        direct_io: write with direct I/O where the filesystem allows it.
        progress: where finished and failed saves are reported.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        keep: int,
        direct_io: bool,
        progress: ProgressReporter,
    ) -> None:
        self._store, self._keep, self._direct_io = store, keep, direct_io
        self._progress = progress
        self.snapshot = StateSnapshot(model=model, optimizer=optimizer)  # model and optimizer
        self.small_snapshot = StateSnapshot()  # the rest: step, RNG, scheduler, extras
        self.writer = BackgroundWriter()
        self.preparing: threading.Thread | None = None  # nothing waits for it
        self.records: collections.deque[SaveRecord] = collections.deque(maxlen=100)
        self._reported: SaveRecord | None = None

    @property
    def busy(self) -> bool:
        """Whether a save is still being written."""
        return self.writer.busy

    def prepare(self, large: dict[str, Any]) -> None:
        """Allocate and fault in (or pin) the buffers of ``large`` in a background thread."""
        try:
            job = self.snapshot.prepare(large)
        except CheckpointStateError:
            return  # the first save says what is wrong with the state
        if job is not None:
            self.preparing = run_in_background(job, name="checkpoint-buffers")

    def start_replicated(self, small: dict[str, Any], large: dict[str, Any], where: Where) -> None:
        """Snapshot ``small`` and ``large`` (the loop waits for this only); write them behind."""
        tree = self.small_snapshot.take(small)
        try:
            # Model and optimizer in their own snapshot: the layout prepare() saw.
            tree.update(self.snapshot.take(large))
        except BaseException:
            self.small_snapshot.release()
            raise
        record = self._record(where)

        def release() -> None:
            self.snapshot.release()
            self.small_snapshot.release()

        def job() -> None:
            try:
                self.snapshot.wait()  # the device-to-host copy in flight, if any
                path, manifest = write_replicated(
                    self._store, tree, step=where.step, world_size=where.world_size,
                    started=where.started, epoch=where.epoch,
                )
            finally:
                release()  # torch.save is done with the buffers
            self._finish(record, path, manifest, where.started)

        self._submit(job, record, on_refused=release)

    def start_sharded(
        self,
        small: dict[str, Any] | None,
        state: dict[str, Any],
        where: Where,
        *,
        group: dist.ProcessGroup | None,
        block: bool,
    ) -> None:
        """Every rank writes its shards of ``state`` through DCP; the rank with ``small``
        (rank 0) commits the checkpoint once they are all written."""
        temp = self._store.new_temp_dir(where.step, token="sharded")  # noqa: S106 (a name)
        taken = self.small_snapshot.take(small) if small is not None else None
        release = self.small_snapshot.release if taken is not None else _nothing
        try:
            future = sharded_io.start_sharded_save(state, temp, group=group, use_async=not block)
        except BaseException:
            release()
            raise
        record = self._record(where)

        def job() -> None:
            try:
                if future is not None:
                    future.result()
                if taken is None:
                    record.save_seconds = time.monotonic() - where.started
                    return
                path, manifest = sharded_io.commit_sharded(
                    self._store, temp, taken, step=where.step, world_size=where.world_size,
                    started=where.started, epoch=where.epoch,
                )
            finally:
                release()
            self._finish(record, path, manifest, where.started)

        self._submit(job, record, on_refused=release)

    def poll(self) -> SaveRecord | None:
        """On the training thread: report a finished save once; return it then (else None)."""
        if self.writer.busy or not self.records:
            return None
        record = self.records[-1]
        if record is self._reported:
            return None
        self._reported = record
        if record.error is not None:
            self._progress.save_failed(record.error)
        elif record.path is not None and record.save_seconds is not None:
            log.info(
                "checkpoint of step %d committed in %.2f s (training blocked %.3f s)",
                record.step, record.save_seconds, record.stall_seconds,
            )
            self._progress.checkpoint_saved(
                step=record.step, wall_time=time.time(), save_seconds=record.save_seconds,
                stall_seconds=record.stall_seconds,
            )
        return record

    def raise_if_failed(self) -> None:
        """Raise the last save's error, if it failed.

        Raises:
            CheckpointError: the error itself, or a CheckpointWriteError wrapping another.
        """
        error = self.writer.last_error
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointWriteError(f"the last checkpoint save failed: {error}") from error

    def close(self) -> None:
        """Finish the save in flight; unhook the optimizer (no snapshot will be taken again)."""
        self.writer.wait()
        self.snapshot.close()

    def _record(self, where: Where) -> SaveRecord:
        record = SaveRecord(step=where.step, stall_seconds=time.monotonic() - where.started)
        self.records.append(record)
        return record

    def _finish(self, record: SaveRecord, path: Path, manifest: Manifest, started: float) -> None:
        """In the writer thread, after a commit: prune, then note the result."""
        pruned = self._store.prune(self._keep)
        if pruned:
            log.debug("deleted checkpoints of steps %s", pruned)
        record.path = path
        record.save_seconds = time.monotonic() - started

    def _submit(
        self, job: Callable[[], None], record: SaveRecord, *, on_refused: Callable[[], None]
    ) -> None:
        """Run ``job`` in the writer; ``on_refused`` releases what it would have released."""

        def guarded() -> None:
            before = _thread_cpu()
            try:
                with use_direct_io(self._direct_io):
                    job()
            except BaseException as exc:
                record.error = str(exc)
                raise
            finally:
                after = _thread_cpu()
                if before is not None and after is not None:
                    record.writer_user_seconds = after[0] - before[0]
                    record.writer_system_seconds = after[1] - before[1]

        try:
            self.writer.submit(guarded, name=f"checkpoint-step-{record.step}")
        except BaseException:
            on_refused()
            raise


def _nothing() -> None:
    """Nothing to release (a rank that took no snapshot)."""


def _thread_cpu() -> tuple[float, float] | None:
    """User and system CPU seconds of the calling thread so far; None off Linux."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    usage = resource.getrusage(who)
    return usage.ru_utime, usage.ru_stime
