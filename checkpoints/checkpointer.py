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
asynchronous by default: the loop waits only for the snapshot, and on a GPU
not even for its device-to-host copy, which runs on a side stream while the
next forward and backward run, the optimizer's next step ordered after it
(:mod:`checkpoints.gpu_copy`). A periodic save
that comes due while the previous one is still being written is skipped with a
log line (replicated) or waits for it (sharded, where ranks must agree);
:meth:`Checkpointer.save`, the stop on SIGTERM and :meth:`Checkpointer.close`
always wait. With ``on_resize=`` given, a planned change of the job's nodes
re-forms the process group at a step boundary without restarting the workers
(:mod:`checkpoints.live`). The policy, the layout and the exit codes are
documented in docs/checkpoints.md.

This module decides when to save, restore and stop; a save is carried out by
:mod:`checkpoints.saving`, the checkpoint to resume from is chosen by
:mod:`checkpoints.restoring`, and the live resize is :mod:`checkpoints.live.resizing`.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints import sharded as sharded_io
from checkpoints.errors import CheckpointError, LiveResizeError
from checkpoints.jit import JIT_ENV, JustInTimeSaver, is_collective_failure
from checkpoints.live import LiveState, Resize
from checkpoints.live.resizing import LiveResizing
from checkpoints.pace import PaceMeter
from checkpoints.progress import PROGRESS_DIR_ENV, ProgressReporter, create_progress_reporter
from checkpoints.restoring import Resume, choose, load_chosen
from checkpoints.saving import SaveRecord, Saves, Where
from checkpoints.signals import EXIT_PREEMPTED, StepConsensus, StopSignal
from checkpoints.state import Stateful, apply_state, capture_rng
from checkpoints.storage import CheckpointStore, Fence

__all__ = ["Checkpointer", "Resume", "SaveRecord"]

log = logging.getLogger(__name__)

_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
#: How many maybe_save calls may pass without optimizer state before the buffers
#: are prepared without it (SGD without momentum never has any).
_PREPARE_CALLS = 10


class Checkpointer(LiveResizing):
    """Atomic, verifiable, asynchronous checkpoints of one training job.

    Args:
        directory: the checkpoint root, shared by all ranks.
        model: the model (the module inside DDP; FSDP2 modules with ``sharded=True``).
        optimizer: its optimizer. With state on a GPU, the checkpointer registers
            a pre-step hook on it (at the first save, removed by :meth:`close`)
            that orders the next step after the snapshot's copy.
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
        scheduled = every_steps is not None or every_seconds is not None
        # Calls of maybe_save left to prepare the snapshot buffers in (see _prepare_buffers).
        self._prepare_calls = _PREPARE_CALLS if scheduled and not sharded and self.rank == 0 else 0
        self._stop = StopSignal(grace_seconds=sigterm_grace_seconds)
        if handle_sigterm:
            self._stop.install()
        self._progress = progress or create_progress_reporter(rank=self.rank)
        if total_steps is not None:
            self._progress.set_total_steps(total_steps)
        # This rank's own pace per step, for the coordinator's stragglers (#27).
        self._pace = PaceMeter(model)
        self._progress.set_pace_source(self._pace.recent)
        # The saves under way; on a GPU, the snapshot's copy runs on a side stream
        # that the optimizer's next step is ordered after (checkpoints.gpu_copy).
        self._saver = Saves(
            self._store, model=model, optimizer=optimizer, keep=keep, direct_io=direct_io,
            progress=self._progress,
        )
        #: The last saves of this rank, newest last.
        self.saves: collections.deque[SaveRecord] = self._saver.records
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
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
        # A collective blocked on a peer that hangs is cut short when the runner says
        # the peer is lost (checkpoints.live.unblock).
        self._unblock = self._make_unblocker()
        if self._live is not None:
            self._live.report(LiveState.READY, step=None)

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
            # Flags: stop, a save due by time, the live resize's (checkpoints.live.Flags:
            # the newest round to act on, the round whose store this rank hosts).
            self._consensus = StepConsensus(self._group, width=4)
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
            chosen, state = choose(self._store, fence, sharded=self._sharded, model=self._model)
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
        manifest, state = load_chosen(
            self._store, path, state, rank=self.rank, sharded=self._sharded, model=self._model,
            optimizer=self._optimizer, group=self._dcp_group,
        )
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
        self._pace.boundary(step)
        self._live_step = step
        self._progress.record(step=step, loss=loss, samples=samples)
        self._poll_writer()
        stop = self._stop.requested
        time_due = self._time_due()
        flags = self._live.flags(world_size=self.world_size) if self._live is not None else None
        resize_round = flags.go if flags is not None else 0
        if self._consensus is not None:
            try:
                agreed_stop, agreed_time, resize_round, hosted = self._consensus.exchange(
                    [int(stop), int(time_due), *(flags or (0, 0))]
                )
                if self._live is not None:
                    self._live.host_said = hosted
            except Exception as exc:  # a member is lost: its reduction failed
                if self._recover_in_place(exc) != step:
                    raise LiveResizeError(
                        f"rank {self.rank} completed step {step}, yet the survivors went on "
                        f"from another step after a member was lost"
                    ) from exc
                agreed_stop, agreed_time, resize_round = int(self._stop.requested), 0, 0
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
            self._remember_rng(step)
            return False
        saved = self._save(step, wait_for_previous=self._sharded, block=not self._async)
        self._remember_rng(step)
        return saved

    def recover(self, exc: BaseException) -> int:
        """The step in flight raised ``exc``: recover in place if a member was lost.

        Call it from the training loop's ``except`` around one step (forward,
        backward, optimizer step). When ``exc`` is a failed collective and the
        live resize is on (``on_resize``), the step is discarded (gradients
        zeroed; the optimizer never stepped on partial gradients), the process
        group re-forms around the survivors in the runner's next round, the
        state syncs, ``on_resize`` is called (:class:`~checkpoints.live.Resize`
        with ``lost=True``) to rebuild DDP and rewind the sampler, and the step
        to go on from is returned: the step that failed, or the next one when
        the other survivors had completed it. No checkpoint is read or written.

        Returns:
            The number of completed steps the state now holds.

        Raises:
            BaseException: ``exc`` again when it cannot be recovered in place
                (no collective failure, no ``on_resize``, sharded state, or no
                tidal runner): the restart path takes over as before.
            LiveResizeError, CheckpointError, RuntimeError: when the recovery fails.
        """
        self._pace.discard()  # the step in flight is not timed
        return self._recover_in_place(exc)

    def save(self, step: int) -> None:
        """Save now (waiting for a save in flight first); asynchronous if ``async_save``.

        Raises:
            CheckpointWriteError: when ``async_save`` is off and the write fails.
        """
        self._save(step, wait_for_previous=True, block=not self._async)

    def close(self) -> None:
        """Finish the save in flight, stop handling SIGTERM, write a last progress report.

        Collective with a process group (every rank drains the step flags' reduction);
        the checkpointer's private group is destroyed here (its threads joined).

        Raises:
            CheckpointWriteError: when the last save failed.
        """
        if self._closed:
            return
        self._closed = True
        if self._jit is not None:
            self._jit.disarm()
        self._saver.close()  # the save in flight; the optimizer's pre-step hook goes
        self._poll_writer()
        # The flags' private group goes now, not at interpreter exit (StepConsensus says why).
        consensus, self._consensus, self._group = self._consensus, None, None
        if consensus is not None:
            consensus.destroy()  # drains the reduction in flight first
        self._stop.uninstall()
        self._progress.flush()
        self._pace.close()
        if self._live is not None:  # no longer able to resize: the runner restarts instead
            self._live.withdraw()
        if self._unblock is not None:
            self._unblock.stop()
        self._saver.raise_if_failed()

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
        self.close()  # destroys the private group
        raise SystemExit(EXIT_PREEMPTED)

    def _save(self, step: int, *, wait_for_previous: bool, block: bool) -> bool:
        if step == self._last_saved_step:
            self._saver.writer.wait() if block else None
            self._poll_writer()
            return False
        if self._saver.busy:
            if not wait_for_previous:
                log.info(
                    "skipping the checkpoint of step %d: the previous save is still being "
                    "written (raise every_steps/every_seconds if this repeats)",
                    step,
                )
                return False
            self._saver.writer.wait()
            self._poll_writer()
        started = time.monotonic()
        self._last_saved_step = step
        self._last_save_time = started
        where = Where(step=step, world_size=self.world_size, epoch=self._epoch, started=started)
        if self._sharded:
            self._saver.start_sharded(
                self._small_state(step) if self.rank == 0 else None,
                sharded_io.sharded_state(self._model, self._optimizer),
                where, group=self._dcp_group, block=block,
            )
        elif self.rank == 0:
            self._saver.start_replicated(self._small_state(step), self._large_state(), where)
        if block:
            self._saver.writer.wait()
            self._poll_writer()
            self._saver.raise_if_failed()
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
        self._saver.prepare(self._large_state())

    def _poll_writer(self) -> None:
        """On the training thread: report a finished save once; a failed one may be retried."""
        record = self._saver.poll()
        if record is not None and record.error is not None:
            self._last_saved_step = None  # let the next save of this step try again
