"""The live resize's state sync: each rank of a new group gets the state of the one furthest ahead.

The same collective sequence runs on every rank (:func:`sync_state`): an
all-gather of each rank's live step; the source is the lowest rank with the
largest step (:func:`checkpoints.live.decide.choose_source`). If some rank is
behind, the source sends its state: the model's tensors broadcast in place,
everything else as a skeleton of plain values (pickled, as DDP trusts its
peers) followed by its tensors, each on the group that suits its device (CPU
tensors on the checkpointer's gloo group, CUDA tensors on the default group).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.errors import CheckpointStateError
from checkpoints.live.decide import choose_source

__all__ = ["SyncResult", "sync_state"]

log = logging.getLogger("checkpoints.live")  # the name it always logged under


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a skeleton: received in order, allocated on its device type."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    cuda: bool


def _split(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """``tree`` with every tensor replaced by a :class:`_Slot` (the tensors appended in order)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach().contiguous())
        return _Slot(len(tensors) - 1, tuple(tree.shape), tree.dtype, tree.is_cuda)
    if isinstance(tree, dict):
        return {key: _split(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return _rebuild(tree, [_split(value, tensors) for value in tree])
    return tree


def _rebuild(like: list[Any] | tuple[Any, ...], values: list[Any]) -> Any:
    """A list or tuple (a named tuple too) of the same type as ``like``."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*values)
    return type(like)(values)


def _slots(skeleton: Any) -> Iterator[_Slot]:
    if isinstance(skeleton, _Slot):
        yield skeleton
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            yield from _slots(value)
    elif isinstance(skeleton, list | tuple):
        for value in skeleton:
            yield from _slots(value)


def _fill(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {key: _fill(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return _rebuild(skeleton, [_fill(value, tensors) for value in skeleton])
    return skeleton


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """What the state sync did for this rank.

    Attributes:
        source: the rank the state came from.
        step: its step (-1: no rank held anything live; nothing was sent).
        state: the state received, when this rank was behind (its model is
            already loaded in place); None when it kept its own.
    """

    source: int
    step: int
    state: dict[str, Any] | None


def sync_state(
    *,
    live_step: int,
    group: dist.ProcessGroup | None,
    model: torch.nn.Module,
    capture: Callable[[], dict[str, Any]],
) -> SyncResult:
    """Give every rank of the current group the state of the rank furthest ahead.

    Every rank of the default group calls this with the same ``group`` (a gloo
    group over all of them; None with a single rank).

    Args:
        live_step: the step this rank holds in memory (-1: nothing live).
        group: the gloo group for the step exchange, the skeleton and CPU tensors.
        model: the model; the source's tensors are broadcast into it in place.
        capture: on the source, the rest of the state (optimizer, scheduler,
            RNG, extras, step ...), a tree of plain values and tensors.

    Returns:
        Who was the source and, on a rank that was behind, the state it received.

    Raises:
        CheckpointStateError: when the model's tensors differ from the source's.
        RuntimeError, DistError: when a collective fails.
    """
    if group is None:
        return SyncResult(source=0, step=live_step, state=None)
    world_size = dist.get_world_size(group)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([live_step], dtype=torch.int64), group=group)
    steps = [int(t.item()) for t in gathered]
    source, top = choose_source(steps)
    if top < 0 or all(step == top for step in steps):
        return SyncResult(source=source, step=top, state=None)
    rank = dist.get_rank()
    behind = steps[rank] < top
    log.info("live state sync: rank %d sends step %d (steps %s)", source, top, steps)
    params = model.state_dict()
    layout = [(name, tuple(t.shape), t.dtype) for name, t in params.items()]
    tensors: list[torch.Tensor] = []
    box: list[Any] = [None, None]
    if rank == source:
        box = [layout, _split(capture(), tensors)]
    dist.broadcast_object_list(box, src=source, group=group)
    source_layout, skeleton = box
    if source_layout != layout:
        raise CheckpointStateError(
            f"this rank's model ({len(layout)} tensors) differs from rank {source}'s "
            f"({len(source_layout)} tensors): the live state does not fit it"
        )
    with torch.no_grad():
        if rank != source:
            device = torch.device("cuda", torch.cuda.current_device()) if any(
                slot.cuda for slot in _slots(skeleton)
            ) else None
            for slot in _slots(skeleton):
                where = device if slot.cuda and device is not None else torch.device("cpu")
                tensors.append(torch.empty(slot.shape, dtype=slot.dtype, device=where))
        every = [*params.values(), *tensors]
        _broadcast_all([t for t in every if not t.is_cuda], src=source, group=group)
        _broadcast_all([t for t in every if t.is_cuda], src=source, group=None)
    state = _fill(skeleton, tensors) if behind else None
    return SyncResult(source=source, step=top, state=state)


#: The most bytes one coalesced broadcast of the state sync carries (DDP's own bucket
#: for its initial broadcast is 250 MB; a smaller one bounds the extra copy).
BUCKET_BYTES = 32 * 1024 * 1024


def _broadcast_all(tensors: list[torch.Tensor], *, src: int,
                   group: dist.ProcessGroup | None) -> None:
    """Broadcast ``tensors`` in place from ``src``: a few flat buffers, not a collective
    per tensor (the model's and the optimizer's dozens or hundreds of tensors each cost a
    round trip: 0.05 s for a small MLP on a quiet machine, 0.3 s on a loaded one).
    CPU tensors go over the gloo group, device tensors over the default group (NCCL on
    GPUs). Uses ``_broadcast_coalesced``, what DDP's constructor broadcasts the model
    with; one broadcast per tensor where a torch lacks it."""
    if not tensors:
        return
    coalesced = getattr(dist, "_broadcast_coalesced", None)
    if coalesced is not None:
        coalesced(group if group is not None else dist.distributed_c10d._get_default_group(),
                  tensors, BUCKET_BYTES, src)
        return
    for tensor in tensors:
        dist.broadcast(tensor, src=src, group=group)
