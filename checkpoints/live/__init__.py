"""Live resize: re-form the process group at a step boundary instead of restarting the workers.

A planned membership change (a node joins; a node is drained, scaled down by a
``PATCH`` or reclaimed) leaves every worker healthy. Rather than stopping them
all and restoring a checkpoint, the runners form the next rendezvous round
while their workers train on, then tell the workers; the workers stop at the
same step boundary, re-create the process group at the new world size and
rank, hand the state to whoever lacks it (a joining process) and go on. It
is turned on by ``Checkpointer(..., on_resize=hook)`` in a distributed job
run by a tidal runner (``TIDAL_PROGRESS_DIR`` set); the hook rebuilds what
depends on the group (DDP, the sampler, the data loader) from :class:`Resize`.

**Files** (in the worker's progress directory): ``live-resize.json`` (the
runner's notice of the next round), ``live-leave.json`` (this node leaves;
its workers exit :data:`EXIT_LEFT`, 77) and each worker's
``live-<local_rank>.json`` (:class:`WorkerLive`). Their names and formats
are the contract with the runner and have one home without torch,
:mod:`checkpoints.protocol.live`.

**Agreement.** The ranks must act at the same step, or the first collective of
the new group pairs the wrong calls. The checkpointer's
:class:`~checkpoints.signals.StepConsensus`, which already agrees on the stop
and save flags one step late, carries one more flag: the round of the newest
notice this rank has seen and not yet acted on (:func:`pending_round`). The
MAX over ranks is read by every rank at the same ``maybe_save`` call; if it is
newer than the rank's round, every rank acts there (:func:`decide`): a rank
whose node leaves drains the reduction in flight and exits; every other rank
waits (bounded) for its own notice of that round, drains, finishes an
asynchronous save in flight, destroys the process group and joins the new
one (:func:`rejoin`).

**State sync** (:func:`sync_state`, the same collective sequence on every
rank of the new group): an all-gather of each rank's live step (the step it
holds in memory; -1 for a process that has restored nothing yet). The source
is the lowest rank with the largest step (:func:`choose_source`). If some
rank is behind, the source sends the checkpoint's state: the model's tensors
are broadcast in place, everything else (optimizer, scheduler, scaler, RNG,
extras, step) as a skeleton of plain values followed by its tensors, each on
the group that suits its device (CPU tensors on the checkpointer's private
gloo group, CUDA tensors on the default group, NCCL on GPUs). A joining
process runs the same sequence as the first thing of ``restore()``, so it
receives the state from a peer instead of reading a checkpoint. The peers of
a job are trusted as DDP trusts them: the skeleton is pickled.

**In-place recovery** (an unplanned loss: a member died). The runner writes
``live-lost.json`` as soon as it learns of the death, forms the next round
without the dead member, and writes a resize notice marked ``lost``. The
worker's step fails in a collective (gloo raises once the dead peer's sockets
close); :meth:`~checkpoints.checkpointer.Checkpointer.recover` (or
``maybe_save`` itself, when the failure surfaces in its own reduction)
discards the step in flight (no optimizer step ran on partial gradients; the
gradients are zeroed), abandons the broken group without draining it, joins
the notice's round, syncs the state (a survivor one step behind receives the
step the others completed) and calls ``on_resize`` with ``lost=True`` and the
step to go on from: the sampler rewinds to that step's batch and the step is
repeated. No save is needed and no completed step is lost.

**Failure.** Anything that goes wrong on this path raises (a notice that does
not come, a peer that does not join the new group in time, a model that does
not fit): the worker fails and the runner falls back to restarting the group
from its checkpoint.

**Where each part lives.** :mod:`checkpoints.protocol.live` (the files),
:mod:`checkpoints.live.decide` (the pure decisions), :mod:`checkpoints.live.link`
(a worker's end of the files), :mod:`checkpoints.live.group` (re-forming the
group), :mod:`checkpoints.live.sync` (the state sync). This module keeps
:class:`Resize` and names them all in one place for the checkpointer.
"""

from __future__ import annotations

import dataclasses

from checkpoints.errors import LiveResizeError
from checkpoints.live.decide import (
    HOST_WAIT_S,
    JOINER_WAIT_S,
    Action,
    Flags,
    choose_source,
    decide,
    pending_flags,
    pending_round,
)
from checkpoints.live.group import RoundStore, rejoin
from checkpoints.live.link import LIVE_NOTICE_WAIT_S, NoticeWatch, WorkerLink, wait_for_notice
from checkpoints.live.sync import SyncResult, sync_state
from checkpoints.protocol.live import (
    EXIT_LEFT,
    LEAVE_NOTICE,
    LOST_NOTICE,
    RESIZE_NOTICE,
    LeaveNotice,
    LiveState,
    LostNotice,
    ResizeNotice,
    WorkerLive,
    clear_live_files,
    read_leave_notice,
    read_lost_notice,
    read_resize_notice,
    read_worker_live,
    worker_live_path,
    write_leave_notice,
    write_lost_notice,
    write_resize_notice,
    write_worker_live,
)

__all__ = [
    "EXIT_LEFT",
    "HOST_WAIT_S",
    "JOINER_WAIT_S",
    "LEAVE_NOTICE",
    "LIVE_NOTICE_WAIT_S",
    "LOST_NOTICE",
    "RESIZE_NOTICE",
    "Action",
    "Flags",
    "LeaveNotice",
    "LiveResizeError",
    "LiveState",
    "LostNotice",
    "NoticeWatch",
    "Resize",
    "ResizeNotice",
    "RoundStore",
    "SyncResult",
    "WorkerLink",
    "WorkerLive",
    "choose_source",
    "clear_live_files",
    "decide",
    "pending_flags",
    "pending_round",
    "read_leave_notice",
    "read_lost_notice",
    "read_resize_notice",
    "read_worker_live",
    "rejoin",
    "sync_state",
    "wait_for_notice",
    "worker_live_path",
    "write_leave_notice",
    "write_lost_notice",
    "write_resize_notice",
    "write_worker_live",
]


@dataclasses.dataclass(frozen=True)
class Resize:
    """What ``on_resize`` is told: the group it now trains in.

    Attributes:
        rank: this process's new global rank.
        world_size: the new world size.
        previous_world_size: the world size before.
        step: the completed optimizer steps the state holds (the sampler's start).
        round: the rendezvous round of the new group.
        lost: the resize recovers from a member lost (an unplanned failure):
            the step in flight was discarded, and ``step`` is where the
            survivors go on from (the sampler rewinds to it).
    """

    rank: int
    world_size: int
    previous_world_size: int
    step: int
    round: int
    lost: bool = False
