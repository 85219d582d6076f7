"""Which checkpoint a restore resumes from, and loading it.

Rank 0 walks the candidates newest first (:func:`choose`): one that is
truncated, half-written, fails its checksum, is refused by
``torch.load(weights_only=True)`` or is ruled out by the restore fence (a late
save of a fenced-out process) is logged and moved aside, and the first that
verifies is the one. Just-in-time saves (:mod:`checkpoints.jit`) take part; the
chosen one gets its step's final name. Every rank then loads what rank 0 chose
(:func:`load_chosen`). The :class:`~checkpoints.checkpointer.Checkpointer`
broadcasts the choice and applies the state.

A replicated checkpoint is read the way that costs least (:func:`read_replicated`;
figures in docs/benchmarks.md, "Restore of a large checkpoint"): its CRC-32 is
checked in place by parallel reads before anything of it is used, then it is
loaded by name. For a model on an accelerator the load is memory-mapped: the
tensors are views of the page cache, and ``load_state_dict`` copies them to the
device, which is the only copy made; whatever ``load_state_dict`` might keep
rather than copy (small tensors such as the optimizer's ``step``, the RNG states,
the extras) is copied off the mapping first, so that nothing refers to the file
once the restore is done. For a model on the CPU the optimizer would keep the
loaded tensors themselves, so they are read into memory of their own instead.
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
from checkpoints.state import STATE_FILE, safe_torch_load
from checkpoints.storage import Candidate, CheckpointStore, Fence, Manifest

__all__ = [
    "Resume",
    "choose",
    "copy_off_mapping",
    "load_chosen",
    "maps_to_device",
    "read_replicated",
]

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
    store: CheckpointStore, fence: Fence, *, sharded: bool, model: torch.nn.Module | None = None
) -> tuple[int, dict[str, Any] | None]:
    """Rank 0: the newest checkpoint that verifies (and, if replicated, loads).

    Just-in-time candidates take part (:mod:`checkpoints.jit`); one that is
    chosen gets its step's final name, and the others are removed. A save
    the fence rules out (made after the last restore by a process of an
    older epoch) is moved aside like a corrupt one. ``model``: what the
    state will be loaded into (see :func:`maps_to_device`).

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
                manifest, state = read_replicated(store, path, mmap=maps_to_device(model))
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
        return read_replicated(store, path, mmap=maps_to_device(model))
    except CheckpointCorruptError as exc:
        raise CheckpointError(
            f"rank {rank} cannot load the checkpoint rank 0 chose: {exc}"
        ) from exc


def maps_to_device(model: torch.nn.Module | None) -> bool:
    """Whether a replicated checkpoint is loaded memory-mapped for ``model``.

    True when every parameter of ``model`` is on an accelerator: then
    ``load_state_dict`` copies the model's and the optimizer's tensors to it
    and keeps none of the loaded ones, so they can stay views of the page cache.
    """
    params = list(model.parameters()) if model is not None else []
    return bool(params) and all(p.device.type not in ("cpu", "meta") for p in params)


def read_replicated(
    store: CheckpointStore, path: Path, *, mmap: bool
) -> tuple[Manifest, dict[str, Any]]:
    """Verify and load a replicated checkpoint: its CRC-32 first, in place, then ``torch.load``.

    Args:
        store: the checkpoints.
        path: the checkpoint.
        mmap: load memory-mapped (for a model on an accelerator: see
            :func:`maps_to_device`); the tensors under ``model`` and
            ``optimizer`` of 1 MiB or more stay views of the file, every
            other tensor is copied off it (:func:`copy_off_mapping`).

    Raises:
        CheckpointCorruptError: when anything about it is wrong, naming the file and why.
    """
    manifest = store.read_manifest(path)
    if manifest.kind != "replicated":
        raise CheckpointCorruptError(path, None, f"it is {manifest.kind}, not replicated")
    with store.open_verified(path, manifest, STATE_FILE) as verified:
        state = safe_torch_load(verified, path=path, name=STATE_FILE, mmap=mmap)
    if not isinstance(state, dict) or state.get("step") != manifest.step:
        raise CheckpointCorruptError(path, STATE_FILE, "it does not hold the manifest's step")
    if mmap:
        state = copy_off_mapping(state)
    return manifest, state


#: Tensors of a memory-mapped load under these keys, at least this large, stay mapped.
_COPIED_BY_LOAD = ("model", "optimizer")
_MAPPED_BYTES = 1 << 20


def copy_off_mapping(state: dict[str, Any]) -> dict[str, Any]:
    """A memory-mapped tree with every tensor copied off the file but the model's and
    optimizer's large ones (which ``load_state_dict`` copies to the device).

    A view kept by anyone (the optimizer keeps its ``step`` tensors as they
    are; the user keeps extras) would hold the whole file's mapping: a deleted
    checkpoint's disk space would stay in use, and a file truncated later would
    fault (SIGBUS) where it is read.
    """

    def own(value: Any, *, keep_large: bool) -> Any:
        if isinstance(value, torch.Tensor):
            if keep_large and value.nbytes >= _MAPPED_BYTES:
                return value
            return value.clone()
        if isinstance(value, dict):
            return {k: own(v, keep_large=keep_large) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(own(v, keep_large=keep_large) for v in value)
        return value

    return {k: own(v, keep_large=k in _COPIED_BY_LOAD) for k, v in state.items()}


def _fenced(epoch: int, fence: Fence) -> str:
    return (
        f"it was saved in epoch {epoch} after the job had restored step {fence.step} in epoch "
        f"{fence.epoch} (a fenced-out process's late save)"
    )
