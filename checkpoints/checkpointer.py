"""The checkpointer a training script adopts in a few lines: restore, maybe_save, close.

::

    ckpt = Checkpointer(directory, model=model, optimizer=optimizer, every_steps=100)
    resume = ckpt.restore()                    # newest valid checkpoint, any world size
    for step in range(resume.step, total_steps):
        ...                                    # one optimizer step
        ckpt.maybe_save(step + 1, loss=loss, samples=global_batch)
    ckpt.close()

Replicated (DDP) state: rank 0 snapshots and writes; every rank reads. Sharded
(FSDP2 / DTensor) state: every rank writes its shards through DCP. Saves are
asynchronous by default: the loop waits only for the snapshot. A periodic save
that comes due while the previous one is still being written is skipped with a
log line (replicated) or waits for it (sharded, where ranks must agree);
:meth:`Checkpointer.save`, the stop on SIGTERM and :meth:`Checkpointer.close`
always wait. With ``on_resize=`` given, a planned change of the job's nodes
re-forms the process group at a step boundary without restarting the workers
(:mod:`checkpoints.live`). The policy, the layout and the exit codes are
documented in docs/checkpoints.md.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import os
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
from checkpoints.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStateError,
    CheckpointWriteError,
)
from checkpoints.files import use_direct_io
from checkpoints.jit import JIT_ENV, JustInTimeSaver, is_collective_failure
from checkpoints.live import (
    EXIT_LEFT,
    Action,
    LiveResizeError,
    LiveState,
    Resize,
    SyncResult,
    WorkerLink,
    rejoin,
    sync_state,
)
from checkpoints.progress import PROGRESS_DIR_ENV, ProgressReporter, create_progress_reporter
from checkpoints.signals import EXIT_PREEMPTED, StepConsensus, StopSignal
from checkpoints.state import (
    Stateful,
    apply_state,
    capture_rng,
    load_replicated,
    write_replicated,
)
from checkpoints.storage import Candidate, CheckpointStore, Fence, Manifest

__all__ = ["Checkpointer", "Resume", "SaveRecord"]

log = logging.getLogger(__name__)

_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
#: How many maybe_save calls may pass without optimizer state before the buffers
#: are prepared without it (SGD without momentum never has any).
_PREPARE_CALLS = 10


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where training resumes.

    Attributes:
        step: completed optimizer steps in the restored checkpoint (0 when fresh).
        fresh: no usable checkpoint was found; nothing was loaded.
        path: the checkpoint loaded, if any.
        saved_world_size: the world size it was saved at, if any.
        extra: the user extras saved with it (``{}`` when fresh).
    """

    step: int
    fresh: bool
    path: Path | None
    saved_world_size: int | None
    extra: dict[str, Any]


@dataclasses.dataclass
class SaveRecord:
    """One save as this rank saw it (``save_seconds`` is None while in flight).

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


class Checkpointer:
    """Atomic, verifiable, asynchronous checkpoints of one training job.

    Args:
        directory: the checkpoint root, shared by all ranks.
        model: the model (the module inside DDP; FSDP2 modules with ``sharded=True``).
        optimizer: its optimizer.
        scheduler: an LR scheduler (anything with state_dict/load_state_dict).
        scaler: a grad scaler.
        extra_state: returns user extras (a dict of JSON-like values and tensors) to save.
        load_extra_state: receives them on restore.
        every_steps: save when the completed step count is a multiple of this.
        every_seconds: save when this long has passed since the last save.
        keep: how many checkpoints to keep (the newest by step).
        async_save: write in the background (the loop waits only for the snapshot).
        sharded: save sharded state through torch.distributed.checkpoint.
        handle_sigterm: save at the next step boundary on SIGTERM and exit with 75.
        sigterm_grace_seconds: after SIGTERM, exit at once if still running this long.
        progress: where to report progress (default: from ``TIDAL_PROGRESS_DIR``).
        total_steps: the step training ends at, if known; reported with the
            progress, so that ``tidal submit`` can estimate the time left.
        direct_io: write checkpoint files with direct I/O, past the page cache
            (buffered where the filesystem refuses it); False: through the page cache.
        jit_save: when a collective fails or the runner says a peer is gone, save
            the last completed step before exiting (replicated state with an
            optimizer, more than one rank; local rank 0 of each node writes; see
            :mod:`checkpoints.jit`). ``TIDAL_JIT_SAVE=0`` in the environment turns
            it off. With it on, ``extra_state`` is called after every step.
        on_resize: turns the live resize on (:mod:`checkpoints.live`; replicated
            state, torch.distributed initialized, ``TIDAL_PROGRESS_DIR`` set):
            called inside ``maybe_save`` after the process group was re-formed
            at a new world size and the state synced, to rebuild DDP and the
            data pipeline for :class:`~checkpoints.live.Resize`. Build DDP after
            :meth:`restore`: a joining process receives the state there.

    Raises:
        ValueError: when an option is out of range.

    With torch.distributed initialized (and more than one rank), every rank
    must construct the checkpointer, call ``restore`` and call ``maybe_save``
    equally often: they make collective calls on private gloo groups.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        extra_state: Callable[[], dict[str, Any]] | None = None,
        load_extra_state: Callable[[dict[str, Any]], None] | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: int = 3,
        async_save: bool = True,
        sharded: bool = False,
        handle_sigterm: bool = True,
        sigterm_grace_seconds: float = 60.0,
        progress: ProgressReporter | None = None,
        total_steps: int | None = None,
        direct_io: bool = True,
        jit_save: bool = True,
        on_resize: Callable[[Resize], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be at least 1")
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps ({every_steps}) must be at least 1")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError(f"every_seconds ({every_seconds}) must be positive")
        self._model, self._optimizer = model, optimizer
        self._scheduler, self._scaler = scheduler, scaler
        self._extra_state, self._load_extra_state = extra_state, load_extra_state
        self._every_steps, self._every_seconds = every_steps, every_seconds
        self._keep, self._async, self._sharded = keep, async_save, sharded
        self._direct_io = direct_io
        self._store = CheckpointStore(directory)
        self._init_distributed()
        # Model and optimizer: on a GPU, copied on a side stream that the optimizer's
        # next step is ordered after (checkpoints.gpu_copy).
        self._snapshot = StateSnapshot(model=model, optimizer=optimizer)
        self._small_snapshot = StateSnapshot()  # the rest: step, RNG, scheduler, extras
        self._writer = BackgroundWriter()
        scheduled = every_steps is not None or every_seconds is not None
        # Calls of maybe_save left to prepare the snapshot buffers in (see _prepare_buffers).
        self._prepare_calls = _PREPARE_CALLS if scheduled and not sharded and self.rank == 0 else 0
        self._preparing: threading.Thread | None = None  # nothing waits for it
        self._stop = StopSignal(grace_seconds=sigterm_grace_seconds)
        if handle_sigterm:
            self._stop.install()
        self._progress = progress or create_progress_reporter(rank=self.rank)
        if total_steps is not None:
            self._progress.set_total_steps(total_steps)
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._reported: SaveRecord | None = None
        self.saves: collections.deque[SaveRecord] = collections.deque(maxlen=100)
        self._closed = False
        # The restore epoch this run saves under (restore takes the next one).
        self._epoch = self._store.read_fence().epoch
        self._jit_wanted = jit_save
        self._jit = self._make_jit(jit_save)
        # The live resize: the step this process holds in memory (-1: nothing
        # yet), and its end of the files its runner talks to it through.
        self._live_step = -1
        self._previous_world_size = self.world_size
        self._on_resize = on_resize
        self._live = self._make_live_link(on_resize)
        if self._live is not None:
            self._live.report(LiveState.READY, step=None)

    def _make_live_link(self, on_resize: Callable[[Resize], None] | None) -> WorkerLink | None:
        """The worker's end of the live-resize files, when the live path can be taken."""
        directory = os.environ.get(PROGRESS_DIR_ENV)
        distributed = dist.is_available() and dist.is_initialized()
        if on_resize is None or not directory or not distributed:
            return None
        if self._sharded:
            log.warning("no live resize with sharded state: a resize restarts the workers")
            return None
        return WorkerLink(Path(directory), local_rank=self._local_rank)

    @property
    def _local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def _make_jit(self, wanted: bool) -> JustInTimeSaver | None:
        local_rank = self._local_rank
        if (
            not wanted
            or os.environ.get(JIT_ENV) == "0"
            or self._sharded
            or self._optimizer is None
            or self.world_size < 2
            or local_rank != 0  # one copy per node is enough: they are all the same
        ):
            return None
        progress_dir = os.environ.get(PROGRESS_DIR_ENV)
        jit = JustInTimeSaver(
            self._store,
            rank=self.rank,
            world_size=self.world_size,
            optimizer=self._optimizer,
            small_state=self._small_state,
            large_state=self._large_state,
            epoch=lambda: self._epoch,
            progress_dir=Path(progress_dir) if progress_dir else None,
        )
        jit.arm()
        return jit

    def _init_distributed(self) -> None:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self._group: dist.ProcessGroup | None = None
        self._dcp_group: dist.ProcessGroup | None = None
        self._consensus: StepConsensus | None = None
        if distributed:
            # Private gloo groups: flags and DCP never share the training group, nor each other.
            self._group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
            # Flags: stop, a save due by time, the newest live-resize round not acted on.
            self._consensus = StepConsensus(self._group, width=3)
            if self._sharded:
                self._dcp_group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)

    @property
    def directory(self) -> Path:
        """The checkpoint root."""
        return self._store.root

    @property
    def stop_requested(self) -> bool:
        """Whether this process received SIGTERM (the stop happens at the next maybe_save)."""
        return self._stop.requested

    # ------------------------------------------------------------------ restore

    def restore(self) -> Resume:
        """Load the newest valid checkpoint (saved at any world size), or start fresh.

        Rank 0 verifies the candidates newest first; one that is truncated,
        half-written, fails its checksum or is refused by ``torch.load(weights_only=True)``
        is logged (which file, why), moved aside and skipped. The choice is
        broadcast so that every rank loads the same one.

        With the live resize on, a process that joins a group whose other
        ranks train on receives their state instead (no checkpoint is read;
        ``Resume.path`` is None).

        Returns:
            Where to resume.

        Raises:
            CheckpointError: when another rank cannot read the checkpoint rank 0
                chose, or the checkpoint does not fit the model.
        """
        if self._live is not None:
            joined = self._restore_live()
            if joined is not None:
                return joined
        chosen, state, epoch = -1, None, 0
        if self.rank == 0:
            stale = self._store.remove_stale()
            if stale:
                log.info("removed %d unfinished save(s): %s", len(stale), ", ".join(stale))
            fence = self._store.read_fence()
            chosen, state = self._choose(fence)
            epoch = fence.epoch + 1
            try:
                self._store.write_fence(Fence(epoch=epoch, step=chosen))
            except CheckpointError as exc:
                log.error("%s: late saves of a fenced-out process will not be refused", exc)
        if self._group is not None:
            box = torch.tensor([chosen, epoch], dtype=torch.int64)
            dist.broadcast(box, src=0, group=self._group)
            chosen, epoch = (int(v) for v in box.tolist())
        self._epoch = epoch
        if chosen < 0:
            log.info("no usable checkpoint under %s: starting fresh", self.directory)
            self._live_step = 0
            return Resume(step=0, fresh=True, path=None, saved_world_size=None, extra={})
        path = self._store.path_of(chosen)
        manifest, state = self._load_chosen(path, state)
        extra = self._apply(  # sharded: DCP loaded the model and optimizer in place already
            state,
            model=None if self._sharded else self._model,
            optimizer=None if self._sharded else self._optimizer,
            path=path,
        )
        self._last_saved_step = chosen
        self._last_save_time = time.monotonic()
        self._live_step = chosen
        log.info(
            "restored step %d from %s (saved at world size %d, now %d)",
            chosen,
            path,
            manifest.world_size,
            self.world_size,
        )
        return Resume(
            step=chosen,
            fresh=False,
            path=path,
            saved_world_size=manifest.world_size,
            extra=extra,
        )

    def _apply(
        self,
        state: dict[str, Any],
        *,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        path: Path,
    ) -> dict[str, Any]:
        """Load a restored tree into ``model``, ``optimizer`` (None: loaded already), the
        scheduler, scaler and RNGs; return the user extras, given to ``load_extra_state``."""
        apply_state(
            state,
            model=model,
            optimizer=optimizer,
            scheduler=self._scheduler,
            scaler=self._scaler,
            path=path,
        )
        extra = dict(state.get("extra") or {})
        if self._load_extra_state is not None:
            self._load_extra_state(extra)
        return extra

    def _choose(self, fence: Fence) -> tuple[int, dict[str, Any] | None]:
        """Rank 0: the newest checkpoint that verifies (and, if replicated, loads).

        Just-in-time candidates take part (:mod:`checkpoints.jit`); one that is
        chosen gets its step's final name, and the others are removed. A save
        the fence rules out (made after the last restore by a process of an
        older epoch) is moved aside like a corrupt one.
        """
        rejected: list[Candidate] = []
        candidates = self._store.candidates()
        for candidate in candidates:
            path = candidate.path
            try:
                if candidate.jit and fence.fences_out(step=candidate.step, epoch=candidate.epoch):
                    raise CheckpointCorruptError(path, None, _fenced(candidate.epoch, fence))
                if self._sharded:
                    manifest = self._store.verify(path)
                    if manifest.kind != "sharded":
                        raise CheckpointCorruptError(path, None, "it is not a sharded checkpoint")
                    state = None
                else:
                    manifest, state = load_replicated(self._store, path)
                if fence.fences_out(step=manifest.step, epoch=manifest.epoch):
                    raise CheckpointCorruptError(path, None, _fenced(manifest.epoch, fence))
            except CheckpointCorruptError as exc:
                log.warning("%s; falling back to an older checkpoint", exc)
                rejected.append(candidate)
                continue
            for bad in rejected:
                moved = self._store.quarantine(bad.step, path=bad.path)
                log.warning("moved rejected checkpoint %s aside to %s", bad.path.name, moved)
            if candidate.jit:
                log.info("resuming from the just-in-time save %s", path.name)
                self._store.promote(candidate)
            for other in candidates:
                if other.jit and other is not candidate:
                    self._store.remove_candidate(other)
            return candidate.step, state
        return -1, None

    def _load_chosen(
        self, path: Path, state: dict[str, Any] | None
    ) -> tuple[Manifest, dict[str, Any]]:
        try:
            if self._sharded:
                return sharded_io.load_sharded(
                    self._store,
                    path,
                    model=self._model,
                    optimizer=self._optimizer,
                    group=self._dcp_group,
                    checksums=self.rank == 0,
                )
            if state is not None:
                return self._store.read_manifest(path), state
            return load_replicated(self._store, path)
        except CheckpointCorruptError as exc:
            raise CheckpointError(
                f"rank {self.rank} cannot load the checkpoint rank 0 chose: {exc}"
            ) from exc

    # --------------------------------------------------------------------- save

    def maybe_save(self, step: int, *, loss: Any = None, samples: int | None = None) -> bool:
        """Call after every optimizer step: report progress, save when due, stop on SIGTERM.

        Args:
            step: completed optimizer steps.
            loss: this step's loss (a tensor is read only when progress is written).
            samples: samples this step consumed over all ranks (for samples/s).

        Returns:
            Whether a save was started.

        Raises:
            SystemExit: with ``EXIT_PREEMPTED`` (75) after saving, when a stop was
                requested; with ``EXIT_LEFT`` (77) when this node leaves on the
                live path.
            CheckpointError, RuntimeError: when a live resize fails (the runner
                restarts the group).
        """
        if self._jit is not None:
            self._jit.boundary(step)  # before any collective of ours can fail
        self._live_step = step
        self._progress.record(step=step, loss=loss, samples=samples)
        self._poll_writer()
        stop = self._stop.requested
        time_due = self._time_due()
        resize_round = self._live.flag() if self._live is not None else 0
        if self._consensus is not None:
            agreed_stop, agreed_time, resize_round = self._consensus.exchange(
                [int(stop), int(time_due), resize_round]
            )
            stop = bool(agreed_stop)
            if self._sharded:  # every rank must take part: decide on the agreed flag
                time_due = bool(agreed_time)
        if stop:
            self._stop_now(step)
        if resize_round:
            self._act_live(step, resize_round)
        steps_due = self._every_steps is not None and step % self._every_steps == 0
        if not (steps_due or time_due):
            if self._prepare_calls:
                self._prepare_buffers()
            return False
        return self._save(step, wait_for_previous=self._sharded, block=not self._async)

    def save(self, step: int) -> None:
        """Save now (waiting for a save in flight first); asynchronous if ``async_save``.

        Raises:
            CheckpointWriteError: when ``async_save`` is off and the write fails.
        """
        self._save(step, wait_for_previous=True, block=not self._async)

    def close(self) -> None:
        """Finish the save in flight, stop handling SIGTERM, write a last progress report.

        Raises:
            CheckpointWriteError: when the last save failed.
        """
        if self._closed:
            return
        self._closed = True
        if self._jit is not None:
            self._jit.disarm()
        self._writer.wait()
        self._snapshot.close()  # the optimizer's pre-step hook goes
        self._poll_writer()
        if self._consensus is not None:
            self._consensus.drain()
        self._stop.uninstall()
        self._progress.flush()
        if self._live is not None:  # no longer able to resize: the runner restarts instead
            self._live.withdraw()
        self._raise_if_failed()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is not None and self._jit is not None and is_collective_failure(exc):
            # The group is broken: save the last completed step; leave without
            # the collectives close() would wait on.
            self._jit.save(f"a collective failed ({type(exc).__name__})")
            self._jit.disarm()
            self._closed = True
            self._stop.uninstall()
            self._progress.flush()
            return
        self.close()

    # -------------------------------------------------------------- live resize

    def _act_live(self, step: int, agreed_round: int) -> None:
        """At the boundary where the ranks agreed on a newer round: leave, resize, or go on."""
        assert self._live is not None
        action = self._live.action(agreed_round)
        if action is Action.LEAVE:
            self._leave(step)
        elif action is Action.RESIZE:
            self._resize(step, agreed_round)

    def _quiesce(self) -> None:
        """Before the group goes away: nothing of ours may still use it."""
        if self._jit is not None:
            self._jit.disarm()
            self._jit = None
        self._writer.wait()  # a save in flight finishes (a sharded one uses the group)
        self._poll_writer()
        if self._consensus is not None:
            self._consensus.drain()  # the reduction launched at this boundary

    def _leave(self, step: int) -> None:
        """This node leaves: exit with EXIT_LEFT at the boundary where the others resize."""
        log.warning(
            "this node leaves the job: rank %d stops at step %d and exits with %d (no save: "
            "the others hold the state)", self.rank, step, EXIT_LEFT,
        )
        self._quiesce()
        assert self._live is not None
        self._live.report(LiveState.LEFT, step=step)
        self._closed = True
        self._stop.uninstall()
        self._progress.flush()
        raise SystemExit(EXIT_LEFT)

    def _resize(self, step: int, agreed_round: int) -> None:
        """Re-form the process group of the agreed round at this boundary and train on.

        Raises:
            LiveResizeError: when this node's notice does not come in time.
            CheckpointError, RuntimeError: when the group or the state sync fails.
        """
        assert self._live is not None and self._on_resize is not None
        started = time.monotonic()
        notice = self._live.notice(agreed_round)
        self._live.report(LiveState.RESIZING, step=step)
        self._previous_world_size = self.world_size
        self._quiesce()
        rejoin(notice, local_rank=self._local_rank)
        self._init_distributed()
        self._progress.rebind(rank=self.rank, world_size=self.world_size)
        self._jit = self._make_jit(self._jit_wanted)
        synced = self._sync_live()
        if synced.state is not None:
            raise LiveResizeError(
                f"rank {self.rank} holds step {step} but rank {synced.source} holds "
                f"{synced.step}: the ranks did not stop at the same step"
            )
        self._live.round = notice.round
        self._on_resize(Resize(
            rank=self.rank, world_size=self.world_size,
            previous_world_size=self._previous_world_size, step=step, round=notice.round,
        ))
        if self._jit is not None:
            self._jit.boundary(step)
        self._live.report(LiveState.RESIZED, step=step)
        log.info(
            "resized live at step %d: rank %d of %d (was %d ranks), round %d, in %.2f s",
            step, self.rank, self.world_size, self._previous_world_size, notice.round,
            time.monotonic() - started,
        )

    def _sync_live(self) -> SyncResult:
        return sync_state(
            live_step=self._live_step, group=self._group, model=self._model,
            capture=self._live_state,
        )

    def _live_state(self) -> dict[str, Any]:
        """What a joining rank receives: a checkpoint's state but the model, and our bookkeeping."""
        state = self._small_state(self._live_step)
        state["optimizer"] = self._optimizer.state_dict() if self._optimizer is not None else None
        state["live"] = {
            "epoch": self._epoch,
            "last_saved_step": self._last_saved_step,
            "world_size": self._previous_world_size,
        }
        return state

    def _restore_live(self) -> Resume | None:
        """A joining process: take the state of the ranks that train on; None if none does."""
        synced = self._sync_live()
        state = synced.state
        if state is None:
            return None
        extra = self._apply(  # the model came in place
            state, model=None, optimizer=self._optimizer,
            path=Path(f"<the live state of rank {synced.source}>"),
        )
        live = state["live"]
        self._epoch = int(live["epoch"])
        self._last_saved_step = live["last_saved_step"]
        self._last_save_time = time.monotonic()
        self._live_step = synced.step
        log.info(
            "joined live at step %d: state received from rank %d (world size %d, was %d)",
            synced.step, synced.source, self.world_size, live["world_size"],
        )
        return Resume(
            step=synced.step, fresh=False, path=None, saved_world_size=int(live["world_size"]),
            extra=extra,
        )

    def _time_due(self) -> bool:
        if self._every_seconds is None:
            return False
        return time.monotonic() - self._last_save_time >= self._every_seconds

    def _stop_now(self, step: int) -> None:
        log.warning("stop requested: saving step %d, then exiting with %d", step, EXIT_PREEMPTED)
        self._progress.stop_requested()
        self._save(step, wait_for_previous=True, block=True)
        if self._consensus is not None:
            self._consensus.drain()
            assert self._group is not None
            dist.barrier(group=self._group)  # nobody leaves before the checkpoint is committed
        self.close()
        raise SystemExit(EXIT_PREEMPTED)

    def _save(self, step: int, *, wait_for_previous: bool, block: bool) -> bool:
        if step == self._last_saved_step:
            self._writer.wait() if block else None
            self._poll_writer()
            return False
        if self._writer.busy:
            if not wait_for_previous:
                log.info(
                    "skipping the checkpoint of step %d: the previous save is still being "
                    "written (raise every_steps/every_seconds if this repeats)",
                    step,
                )
                return False
            self._writer.wait()
            self._poll_writer()
        started = time.monotonic()
        self._last_saved_step = step
        self._last_save_time = started
        if self._sharded:
            self._start_sharded(step, started, block=block)
        elif self.rank == 0:
            self._start_replicated(step, started)
        if block:
            self._writer.wait()
            self._poll_writer()
            self._raise_if_failed()
        return True

    def _small_state(self, step: int) -> dict[str, Any]:
        extra = self._extra_state() if self._extra_state is not None else {}
        if not isinstance(extra, dict):
            raise CheckpointError(f"extra_state returned a {type(extra).__name__}, not a dict")
        return {
            "step": step,
            "world_size": self.world_size,
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "rng": capture_rng(),
            "extra": extra,
        }

    def _large_state(self) -> dict[str, Any]:
        return {
            "model": self._model.state_dict(),
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
        }

    def _prepare_buffers(self) -> None:
        """Before the first save: allocate and fault in the snapshot buffers in the background.

        Faulting in hundreds of MB of fresh memory costs several times the copy
        itself; done by a thread ahead of time, the first save only copies (if
        it comes first, it allocates as before; nothing waits for the thread).
        The thread runs at normal priority: it is one short pass over memory,
        and at niceness 19 on a busy machine it lost the race to the first save
        while slowing it. The optimizer's state (Adam's moments) appears at its
        first step, so this waits for it, for a few calls at most.
        """
        self._prepare_calls -= 1
        if self._optimizer is not None and not self._optimizer.state and self._prepare_calls:
            return
        self._prepare_calls = 0
        try:
            job = self._snapshot.prepare(self._large_state())
        except CheckpointStateError:
            return  # the first save says what is wrong with the state
        if job is not None:
            self._preparing = run_in_background(job, name="checkpoint-buffers")

    def _start_replicated(self, step: int, started: float) -> None:
        tree = self._small_snapshot.take(self._small_state(step))
        try:
            # Model and optimizer in their own snapshot: the layout _prepare_buffers saw.
            tree.update(self._snapshot.take(self._large_state()))
        except BaseException:
            self._small_snapshot.release()
            raise
        record = SaveRecord(step=step, stall_seconds=time.monotonic() - started)
        self.saves.append(record)

        def release() -> None:
            self._snapshot.release()
            self._small_snapshot.release()

        def job() -> None:
            try:
                self._snapshot.wait()  # the device-to-host copy in flight, if any
                path, manifest = write_replicated(
                    self._store, tree, step=step, world_size=self.world_size, started=started,
                    epoch=self._epoch,
                )
            finally:
                release()  # torch.save is done with the buffers
            self._finish(record, path, manifest, started)

        self._submit(job, record, on_refused=release)

    def _start_sharded(self, step: int, started: float, *, block: bool) -> None:
        temp = self._store.new_temp_dir(step, token="sharded")  # noqa: S106 (a name, not a secret)
        state = sharded_io.sharded_state(self._model, self._optimizer)
        small = self._small_snapshot.take(self._small_state(step)) if self.rank == 0 else None
        release = self._small_snapshot.release if small is not None else _nothing
        try:
            future = sharded_io.start_sharded_save(
                state, temp, group=self._dcp_group, use_async=not block
            )
        except BaseException:
            release()
            raise
        record = SaveRecord(step=step, stall_seconds=time.monotonic() - started)
        self.saves.append(record)

        def job() -> None:
            try:
                if future is not None:
                    future.result()
                if small is None:
                    record.save_seconds = time.monotonic() - started
                    return
                path, manifest = sharded_io.commit_sharded(
                    self._store, temp, small, step=step, world_size=self.world_size,
                    started=started, epoch=self._epoch,
                )
            finally:
                release()
            self._finish(record, path, manifest, started)

        self._submit(job, record, on_refused=release)

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
            self._writer.submit(guarded, name=f"checkpoint-step-{record.step}")
        except BaseException:
            on_refused()
            raise

    def _poll_writer(self) -> None:
        """On the training thread: report a finished save once."""
        if self._writer.busy or not self.saves:
            return
        record = self.saves[-1]
        if record is self._reported:
            return
        self._reported = record
        if record.error is not None:
            self._progress.save_failed(record.error)
            self._last_saved_step = None  # let the next save of this step try again
        elif record.path is not None and record.save_seconds is not None:
            log.info(
                "checkpoint of step %d committed in %.2f s (training blocked %.3f s)",
                record.step,
                record.save_seconds,
                record.stall_seconds,
            )
            self._progress.checkpoint_saved(
                step=record.step,
                wall_time=time.time(),
                save_seconds=record.save_seconds,
                stall_seconds=record.stall_seconds,
            )

    def _raise_if_failed(self) -> None:
        error = self._writer.last_error
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointWriteError(f"the last checkpoint save failed: {error}") from error


def _fenced(epoch: int, fence: Fence) -> str:
    return (
        f"it was saved in epoch {epoch} after the job had restored step {fence.step} in epoch "
        f"{fence.epoch} (a fenced-out process's late save)"
    )


def _nothing() -> None:
    """Nothing to release (a rank that took no snapshot)."""


def _thread_cpu() -> tuple[float, float] | None:
    """User and system CPU seconds of the calling thread so far; None off Linux."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    usage = resource.getrusage(who)
    return usage.ru_utime, usage.ru_stime
