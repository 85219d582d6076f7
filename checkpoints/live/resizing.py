"""The live resize at a step boundary, as the checkpointer takes part in it.

With ``on_resize=`` given (and the runner's files to talk through), the ranks
agree at each ``maybe_save`` on the newest resize round their runners
announced (:mod:`checkpoints.live`). At the boundary where they do, a node that
leaves exits with :data:`~checkpoints.live.EXIT_LEFT`; the others re-form the
process group of the new round, sync the state to joining ranks and call
``on_resize`` to rebuild DDP and the data pipeline, without a restart. A joining
process receives the state in :meth:`~checkpoints.checkpointer.Checkpointer.restore`.

After an unplanned loss the group is broken and cannot agree on anything:
:meth:`LiveResizing._recover_in_place` abandons it, takes the runner's next
round (a notice marked ``lost``), syncs the state from the survivor furthest
ahead, rewinds the random generators to the start of the step to repeat
(:meth:`LiveResizing._remember_rng`) and calls ``on_resize`` with it.

:class:`LiveResizing` is the part of the
:class:`~checkpoints.checkpointer.Checkpointer` that does this; the names it
declares without defining are the checkpointer's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.jit import JustInTimeSaver, is_collective_failure
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
from checkpoints.live.unblock import Unblocker
from checkpoints.progress import PROGRESS_DIR_ENV, ProgressReporter
from checkpoints.restoring import Resume
from checkpoints.saving import Saves
from checkpoints.signals import StepConsensus, StopSignal
from checkpoints.state import capture_rng, restore_rng

__all__ = ["LiveResizing"]

log = logging.getLogger("checkpoints.checkpointer")


class LiveResizing:
    """Leave, resize or join live at a step boundary (a mixin of the Checkpointer)."""

    # The checkpointer's, set in its constructor.
    rank: int
    world_size: int
    _model: torch.nn.Module
    _optimizer: torch.optim.Optimizer | None
    _sharded: bool
    _group: dist.ProcessGroup | None
    _consensus: StepConsensus | None
    _jit: JustInTimeSaver | None
    _jit_wanted: bool
    _saver: Saves
    _progress: ProgressReporter
    _stop: StopSignal
    _closed: bool
    _epoch: int
    _last_saved_step: int | None
    _last_save_time: float
    # The live resize's own: the step this process holds in memory (-1: nothing
    # yet), the world size before the last resize, the callback, the runner's files.
    _live_step: int
    _previous_world_size: int
    _on_resize: Callable[[Resize], None] | None
    _live: WorkerLink | None
    _unblock: Unblocker | None
    # The random generators' states at the last step boundary, and its step: a step
    # discarded after a lost member is taken again from them (see _remember_rng).
    _step_rng: tuple[int, dict[str, Any]] | None = None
    # When the checkpointer was made (wall clock, monotonic): a joiner's start-up, logged.
    _made_at: tuple[float, float] = (0.0, 0.0)
    # The checkpointer's methods this part calls.
    _init_distributed: Callable[[], None]
    _make_jit: Callable[[bool], JustInTimeSaver | None]
    _small_state: Callable[[int], dict[str, Any]]
    _apply: Callable[..., dict[str, Any]]
    _poll_writer: Callable[[], None]

    @property
    def _local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def _make_live_link(self, on_resize: Callable[[Resize], None] | None) -> WorkerLink | None:
        """The worker's end of the live-resize files, when the live path can be taken."""
        self._made_at = (time.time(), time.monotonic())
        directory = os.environ.get(PROGRESS_DIR_ENV)
        distributed = dist.is_available() and dist.is_initialized()
        if on_resize is None or not directory or not distributed:
            return None
        if self._sharded:
            log.warning("no live resize with sharded state: a resize restarts the workers")
            return None
        return WorkerLink(Path(directory), local_rank=self._local_rank)

    def _make_unblocker(self) -> Unblocker | None:
        """The watchdog that gets a collective blocked on a hung peer out (live path only)."""
        if self._live is None:
            return None
        unblock = Unblocker(self._live.directory).start()
        unblock.record()
        return unblock

    def _groups_formed(self) -> None:
        """After a re-form: the watchdog guards the new groups' sockets."""
        if self._unblock is not None:
            self._unblock.record()

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
        self._saver.writer.wait()  # a save in flight finishes (a sharded one uses the group)
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
        if self._unblock is not None:
            self._unblock.handled()
        quiet = time.monotonic()
        rejoin(notice, local_rank=self._local_rank, store=self._live.take_store(notice))
        joined = time.monotonic()
        self._init_distributed()
        self._groups_formed()
        self._progress.rebind(rank=self.rank, world_size=self.world_size)
        self._jit = self._make_jit(self._jit_wanted)
        formed = time.monotonic()
        synced = self._sync_live()
        sync_done = time.monotonic()
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
        done = time.monotonic()
        log.info(
            "resized live at step %d: rank %d of %d (was %d ranks), round %d, in %.2f s "
            "(notice and drain %.2f s, init_process_group %.2f s, own groups %.2f s, "
            "state sync %.2f s, on_resize %.2f s)",
            step, self.rank, self.world_size, self._previous_world_size, notice.round,
            done - started, quiet - started, joined - quiet, formed - joined,
            sync_done - formed, done - sync_done,
        )

    def _remember_rng(self, step: int) -> None:
        """At the boundary after ``step``, with the in-place path on: the generators'
        states the next step starts from (torch's, CUDA's, ``random``'s, numpy's; tens of
        microseconds). A step discarded after a lost member is then taken again with the
        same dropout masks and augmentations, as if it had never started."""
        if self._live is not None and self._on_resize is not None:
            self._step_rng = (step, capture_rng())

    def _recover_in_place(self, exc: BaseException) -> int:
        """A collective of the step in flight failed (a member is lost): re-form the group
        without it, keep this process, and return the step to go on from.

        The step in flight is discarded: its gradients are zeroed (no optimizer
        step ran on them: DDP's all-reduce failed inside backward, or the step
        had completed and the failure came in the boundary's own reduction).
        The broken group is abandoned without draining it; the runner's notice
        of the next round (marked ``lost``) is awaited; the state comes from the
        survivor furthest ahead (a rank whose all-reduce completed before the
        peer died is one step ahead of one whose did not), and ``on_resize``
        rebuilds DDP and rewinds the sampler to the returned step.

        Raises:
            BaseException: ``exc`` itself, when it is no failed collective or
                the live path is off (the restart path takes over).
            LiveResizeError: when the runner's notice does not come in time.
            CheckpointError, RuntimeError: when the new group or the state sync fails.
        """
        if self._live is None or self._on_resize is None or not is_collective_failure(exc):
            raise exc
        started = time.monotonic()
        step = self._live_step
        log.warning("rank %d: a collective failed at step %d (%s): recovering in place",
                    self.rank, step, str(exc).splitlines()[0][:200] if str(exc) else
                    type(exc).__name__)
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self._live.report(LiveState.BROKEN, step=step)
        notice = self._live.lost_notice()
        detected = time.monotonic()
        self._abandon()
        self._previous_world_size = self.world_size
        rejoin(notice, local_rank=self._local_rank, store=self._live.take_store(notice))
        self._init_distributed()
        self._groups_formed()
        self._progress.rebind(rank=self.rank, world_size=self.world_size)
        joined = time.monotonic()
        synced = self._sync_live()
        if synced.state is not None:  # one step behind: take the step the others completed
            self._take_live_state(synced)
            step = synced.step
        elif self._step_rng is not None and self._step_rng[0] == step:
            # The step after ``step`` is taken again: from the generators' states it
            # started from. (A failure in the boundary's own reduction, before they
            # were remembered, completed its step: nothing is taken again.)
            restore_rng(self._step_rng[1])
        self._live_step = step
        self._jit = self._make_jit(self._jit_wanted)
        self._live.round = notice.round
        self._on_resize(Resize(
            rank=self.rank, world_size=self.world_size,
            previous_world_size=self._previous_world_size, step=step, round=notice.round,
            lost=True,
        ))
        if self._jit is not None:
            self._jit.boundary(step)
        self._live.report(LiveState.RESIZED, step=step)
        log.warning(
            "recovered in place at step %d: rank %d of %d (was %d ranks), round %d, in %.2f s "
            "(notice %.2f s, re-form %.2f s, sync and on_resize %.2f s)",
            step, self.rank, self.world_size, self._previous_world_size, notice.round,
            time.monotonic() - started, detected - started, joined - detected,
            time.monotonic() - joined,
        )
        return step

    def _abandon(self) -> None:
        """Before a broken group goes away: nothing of ours waits on it (no drain)."""
        if self._unblock is not None:
            self._unblock.handled()
        if self._jit is not None:
            self._jit.disarm()
            self._jit = None
        self._saver.writer.wait()  # a replicated save uses no group
        self._poll_writer()
        self._consensus = None  # its reduction in flight failed or never completes

    def _take_live_state(self, synced: SyncResult) -> None:
        """Load the state another rank sent (its model came in place already)."""
        state = synced.state
        assert state is not None
        self._apply(state, model=None, optimizer=self._optimizer,
                    path=Path(f"<the live state of rank {synced.source}>"))
        live = state["live"]
        self._epoch = int(live["epoch"])
        self._last_saved_step = live["last_saved_step"]

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
        asked = time.monotonic()
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
        made_wall, made = self._made_at
        started = _process_started()
        log.info(
            "joined live at step %d: state received from rank %d (world size %d, was %d); "
            "process up %s s when its process group and checkpointer were made, "
            "%.2f s to restore(), state sync %.2f s",
            synced.step, synced.source, self.world_size, live["world_size"],
            "?" if started is None else f"{made_wall - started:.2f}", asked - made,
            time.monotonic() - asked,
        )
        return Resume(
            step=synced.step, fresh=False, path=None, saved_world_size=int(live["world_size"]),
            extra=extra,
        )


def _process_started() -> float | None:
    """When this process started (the wall clock, to 10 ms; a zygote's child: its fork)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
