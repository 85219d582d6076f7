"""Which checkpoint a restore resumes from, and loading it.

Rank 0 walks the candidates newest first (:func:`choose`): one that is
truncated, half-written, fails its checksum, is refused by
``torch.load(weights_only=True)`` or is ruled out by the restore fence (a late
save of a fenced-out process) is logged and moved aside, and the first that
verifies is the one. Just-in-time saves (:mod:`checkpoints.jit`) take part; the
chosen one gets its step's final name. Every rank then loads what rank 0 chose
(:func:`load_chosen`). The :class:`~checkpoints.checkpointer.Checkpointer`
broadcasts the choice and applies the state.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints import sharded as sharded_io
from checkpoints.errors import CheckpointCorruptError, CheckpointError
from checkpoints.state import load_replicated
from checkpoints.storage import Candidate, CheckpointStore, Fence, Manifest

__all__ = ["Resume", "choose", "load_chosen"]

log = logging.getLogger(__name__)


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


def choose(
    store: CheckpointStore, fence: Fence, *, sharded: bool
) -> tuple[int, dict[str, Any] | None]:
    """Rank 0: the newest checkpoint that verifies (and, if replicated, loads).

    Just-in-time candidates take part (:mod:`checkpoints.jit`); one that is
    chosen gets its step's final name, and the others are removed. A save
    the fence rules out (made after the last restore by a process of an
    older epoch) is moved aside like a corrupt one.

    Returns:
        The chosen step and, for replicated state, its loaded tree; (-1, None)
        when none is usable.
    """
    rejected: list[Candidate] = []
    candidates = store.candidates()
    for candidate in candidates:
        path = candidate.path
        try:
            if candidate.jit and fence.fences_out(step=candidate.step, epoch=candidate.epoch):
                raise CheckpointCorruptError(path, None, _fenced(candidate.epoch, fence))
            if sharded:
                manifest = store.verify(path)
                if manifest.kind != "sharded":
                    raise CheckpointCorruptError(path, None, "it is not a sharded checkpoint")
                state = None
            else:
                manifest, state = load_replicated(store, path)
            if fence.fences_out(step=manifest.step, epoch=manifest.epoch):
                raise CheckpointCorruptError(path, None, _fenced(manifest.epoch, fence))
        except CheckpointCorruptError as exc:
            log.warning("%s; falling back to an older checkpoint", exc)
            rejected.append(candidate)
            continue
        for bad in rejected:
            moved = store.quarantine(bad.step, path=bad.path)
            log.warning("moved rejected checkpoint %s aside to %s", bad.path.name, moved)
        if candidate.jit:
            log.info("resuming from the just-in-time save %s", path.name)
            store.promote(candidate)
        for other in candidates:
            if other.jit and other is not candidate:
                store.remove_candidate(other)
        return candidate.step, state
    return -1, None


def load_chosen(
    store: CheckpointStore,
    path: Path,
    state: dict[str, Any] | None,
    *,
    rank: int,
    sharded: bool,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
) -> tuple[Manifest, dict[str, Any]]:
    """Load the checkpoint rank 0 chose (``state``: what rank 0 loaded already, if any).

    Sharded state is loaded into ``model`` and ``optimizer`` in place through
    DCP over ``group``; the tree returned is the rest.

    Raises:
        CheckpointError: this rank cannot read it.
    """
    try:
        if sharded:
            return sharded_io.load_sharded(
                store, path, model=model, optimizer=optimizer, group=group, checksums=rank == 0
            )
        if state is not None:
            return store.read_manifest(path), state
        return load_replicated(store, path)
    except CheckpointCorruptError as exc:
        raise CheckpointError(
            f"rank {rank} cannot load the checkpoint rank 0 chose: {exc}"
        ) from exc


def _fenced(epoch: int, fence: Fence) -> str:
    return (
        f"it was saved in epoch {epoch} after the job had restored step {fence.step} in epoch "
        f"{fence.epoch} (a fenced-out process's late save)"
    )
