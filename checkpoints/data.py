"""Elastic data position and a constant global batch: which samples each rank trains on.

A job that is restarted at another world size must see exactly the samples the
uninterrupted job would have seen, and learn at the same pace. Both follow from
keying everything on the *global sample position* rather than on the rank:

* The training data is one endless stream of epochs. Epoch ``e`` is the
  permutation of ``range(dataset_len)`` drawn by ``torch.randperm`` from a
  generator seeded with ``seed + e``; the stream is epoch 0, then epoch 1, ...
* Global step ``s`` with global batch ``B`` consumes stream positions
  ``[s*B, (s+1)*B)``. A batch may straddle two epochs; no position is ever
  dropped, so within an epoch no sample repeats and none is skipped.
* Rank ``r`` of ``W`` takes a contiguous slice of that batch. When ``B`` is not a
  multiple of ``W`` the first ``B % W`` ranks take one sample more.
* Each rank multiplies the *sum* of its per-sample losses by
  ``BatchPlan.loss_scale`` (``W / B``), so that DDP's average of the ranks'
  gradients is the mean gradient over the ``B`` samples, whatever ``W`` is and
  however unevenly the batch was split.
* When a rank's share does not fit in memory (``max_local_batch``), it is split
  into micro-batches for gradient accumulation; every rank runs the same number
  of passes and the loss scale is unchanged.

Resumed at step ``s``, :class:`ElasticBatchSampler` starts at position ``s*B``:
nothing in it depends on how many workers consumed the earlier steps. Its
``state_dict()`` holds exactly that pair, the step and the stream position, so
a data loader's saved state (torchdata's ``StatefulDataLoader`` keeps the
sampler's) loads at any world size.

Scaling the learning rate with the world size instead of keeping the global
batch constant is an explicit choice (:func:`scale_lr`); by default nothing
changes when a job is resized.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpoints.errors import CheckpointError
from checkpoints.protocol import env as worker_env

__all__ = [
    "RESIZE_POLICY_ENV",
    "SAMPLER_STATE_FORMAT",
    "BatchPlan",
    "BatchPlanError",
    "ElasticBatchSampler",
    "scale_lr",
]

#: Environment variable through which a job may declare its learning-rate rule.
RESIZE_POLICY_ENV = worker_env.RESIZE_POLICY

#: The ``format`` of :meth:`ElasticBatchSampler.state_dict`; its version is 1.
SAMPLER_STATE_FORMAT = "tidal-batch-sampler"
_SAMPLER_STATE_VERSION = 1
_STATE_KEYS = ("format", "version", "step", "position", "dataset_len", "seed", "within_step")
_WITHIN_STEP_KEYS = ("micro_batch", "global_batch_size", "world_size", "accumulation_steps")

_LR_RULES = ("none", "linear", "sqrt")


class BatchPlanError(CheckpointError, ValueError):
    """A batch plan, sampler or learning-rate rule that makes no sense, naming the values."""


def _require_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BatchPlanError(f"{name} ({value!r}) must be an int")
    if value < minimum:
        raise BatchPlanError(f"{name} ({value}) must be at least {minimum}")
    return value


def _share(global_batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Offset and size of ``rank``'s contiguous slice of a global batch."""
    base, extra = divmod(global_batch_size, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _split(total: int, parts: int) -> tuple[int, ...]:
    """Split ``total`` into ``parts`` sizes within one of each other, the larger first."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


@dataclass(frozen=True)
class BatchPlan:
    """How one rank takes part in a global step of ``global_batch_size`` samples.

    Attributes:
        global_batch_size: samples per optimizer step, over all ranks.
        world_size: number of ranks sharing each step.
        rank: this rank.
        local_offset: where this rank's slice starts within the global batch.
        local_batch_size: this rank's share of the step (uneven when
            ``global_batch_size % world_size != 0``).
        micro_batches: sizes of the micro-batches this rank runs per step, in
            order; more than one means gradient accumulation. All ranks run
            the same number.
        loss_scale: multiply the sum of this rank's per-sample losses (over all
            its micro-batches) by this, so that the DDP-averaged gradient equals
            the mean gradient over the global batch.
    """

    global_batch_size: int
    world_size: int
    rank: int
    local_offset: int
    local_batch_size: int
    micro_batches: tuple[int, ...]
    loss_scale: float

    @classmethod
    def create(
        cls,
        *,
        global_batch_size: int,
        world_size: int,
        rank: int,
        max_local_batch: int | None = None,
    ) -> BatchPlan:
        """Plan rank ``rank``'s share of a global batch at world size ``world_size``.

        Args:
            global_batch_size: samples per optimizer step over all ranks; kept
                constant across world sizes.
            world_size: number of ranks.
            rank: this rank, in ``[0, world_size)``.
            max_local_batch: the most samples one forward/backward pass may
                hold; a larger share is split into micro-batches for gradient
                accumulation. Every rank runs the same number of passes (that of
                the largest share), as FSDP, and DDP with buffers, need the same
                number of forward calls on every rank. ``None``: no limit.

        Returns:
            The plan.

        Raises:
            BatchPlanError: an argument is not an int, a size is not positive,
                the rank is out of range, the global batch is smaller than the
                world size (a rank would have nothing to train on), or a smaller
                share cannot be split into as many passes as the largest (only
                with ``max_local_batch=1`` and an uneven split).
        """
        _require_int("global_batch_size", global_batch_size, minimum=1)
        _require_int("world_size", world_size, minimum=1)
        _require_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise BatchPlanError(f"rank ({rank}) is out of range for world_size ({world_size})")
        if global_batch_size < world_size:
            raise BatchPlanError(
                f"global_batch_size ({global_batch_size}) is smaller than world_size "
                f"({world_size}): every rank needs at least one sample per step"
            )
        passes = 1
        largest_share = -(-global_batch_size // world_size)
        if max_local_batch is not None:
            _require_int("max_local_batch", max_local_batch, minimum=1)
            passes = -(-largest_share // max_local_batch)
        smallest_share = global_batch_size // world_size
        if smallest_share < passes:
            # Refused on every rank alike, so that no rank starts a step the others cannot.
            raise BatchPlanError(
                f"max_local_batch ({max_local_batch}) needs {passes} passes per step for the "
                f"largest share of global_batch_size ({global_batch_size}) over world_size "
                f"({world_size}), but the smallest share has only {smallest_share} samples: "
                "every rank must run the same number of passes; raise max_local_batch or "
                "make the global batch a multiple of the world size"
            )
        offset, size = _share(global_batch_size, world_size, rank)
        return cls(
            global_batch_size=global_batch_size,
            world_size=world_size,
            rank=rank,
            local_offset=offset,
            local_batch_size=size,
            micro_batches=_split(size, passes),
            loss_scale=world_size / global_batch_size,
        )

    @property
    def accumulation_steps(self) -> int:
        """Number of micro-batches (forward/backward passes) per optimizer step."""
        return len(self.micro_batches)

    @property
    def local_slice(self) -> slice:
        """This rank's positions within the global batch."""
        return slice(self.local_offset, self.local_offset + self.local_batch_size)


class ElasticBatchSampler:
    """The index lists one rank trains on, keyed on the global sample position.

    Iterating yields, for each global step from ``start_step`` on, this rank's
    micro-batches of that step (one list per micro-batch, in order; a single
    list without accumulation). It can be passed to
    ``torch.utils.data.DataLoader(dataset, batch_sampler=sampler)``, with worker
    processes or without: the indices are computed in the main process.

    Without ``end_step`` the sampler is endless (the training loop decides when
    to stop) and has no ``len()``. Each ``iter()`` starts again at
    ``start_step`` (or at the state last loaded), and :meth:`state_dict` says
    how far the newest iterator got, for torchdata's ``StatefulDataLoader``.
    Each epoch's permutation is computed when first needed (``dataset_len``
    int64 values) and at most two are kept.
    ``torch.randperm`` draws them, so the order is reproducible with the same
    torch version; resuming a job under another torch version may change it.
    """

    def __init__(
        self,
        *,
        dataset_len: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        start_step: int = 0,
        max_local_batch: int | None = None,
        end_step: int | None = None,
        start_position: int | None = None,
    ) -> None:
        """Create the sampler for ``rank`` of ``world_size``.

        Args:
            dataset_len: number of samples in the dataset.
            global_batch_size: samples per global step over all ranks.
            rank: this rank.
            world_size: number of ranks.
            seed: epoch ``e`` is shuffled with seed ``seed + e``.
            start_step: the first global step to yield (completed steps on resume).
            max_local_batch: see :meth:`BatchPlan.create`.
            end_step: stop before this global step; ``None``: never stop.
            start_position: the stream position at which ``start_step``
                begins. ``None`` (the default, for a constant global batch):
                ``start_step * global_batch_size``. A job whose global batch
                changed along the way passes the number of samples it has
                consumed so far (kept in its checkpoint's extra state).

        Raises:
            BatchPlanError: as :meth:`BatchPlan.create`, or a non-positive
                ``dataset_len``, a negative ``start_step`` or
                ``start_position``, or ``end_step`` before ``start_step``.
        """
        self.plan = BatchPlan.create(
            global_batch_size=global_batch_size,
            world_size=world_size,
            rank=rank,
            max_local_batch=max_local_batch,
        )
        self.dataset_len = _require_int("dataset_len", dataset_len, minimum=1)
        self.seed = _require_int("seed", seed, minimum=0)
        self.start_step = _require_int("start_step", start_step, minimum=0)
        if end_step is not None:
            _require_int("end_step", end_step, minimum=0)
            if end_step < start_step:
                raise BatchPlanError(f"end_step ({end_step}) is before start_step ({start_step})")
        self.end_step = end_step
        if start_position is None:
            start_position = start_step * global_batch_size
        self.start_position = _require_int("start_position", start_position, minimum=0)
        # Micro-batches of start_step already consumed (only from a state saved mid-step).
        self._start_micro_batch = 0
        # How far the newest iterator got: the next step, and its micro-batches already yielded.
        self._cursor = (start_step, 0)
        self._permutations: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch``: a permutation of ``range(dataset_len)``."""
        perm = self._permutations.get(epoch)
        if perm is None:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.dataset_len, generator=generator)
            if len(self._permutations) >= 2:
                del self._permutations[min(self._permutations)]
            self._permutations[epoch] = perm
        return perm

    def indices_at(self, start: int, stop: int) -> list[int]:
        """Sample indices at stream positions ``[start, stop)``, across epochs."""
        out: list[int] = []
        position = start
        while position < stop:
            epoch, offset = divmod(position, self.dataset_len)
            take = min(stop - position, self.dataset_len - offset)
            out.extend(self.permutation(epoch)[offset : offset + take].tolist())
            position += take
        return out

    def position_of(self, step: int) -> int:
        """The stream position at which global step ``step`` begins.

        Raises:
            BatchPlanError: ``step`` would begin before the start of the stream.
        """
        position = self.start_position + (step - self.start_step) * self.plan.global_batch_size
        if position < 0:
            raise BatchPlanError(f"step ({step}) would begin before the start of the stream")
        return position

    def global_indices(self, step: int) -> list[int]:
        """All ``global_batch_size`` sample indices of global step ``step``, rank 0's first."""
        start = self.position_of(step)
        return self.indices_at(start, start + self.plan.global_batch_size)

    def indices_for_step(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of global step ``step``."""
        start = self.position_of(step) + self.plan.local_offset
        flat = self.indices_at(start, start + self.plan.local_batch_size)
        batches: list[list[int]] = []
        for size in self.plan.micro_batches:
            batches.append(flat[:size])
            flat = flat[size:]
        return batches

    def epoch_of(self, step: int) -> int:
        """The epoch in which global step ``step`` begins."""
        return self.position_of(step) // self.dataset_len

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator itself: the cursor moves back to the start at iter(), as a
        # data loader's state taken before its first batch must say.
        self._cursor = (self.start_step, self._start_micro_batch)
        return self._batches(self.start_step, self._start_micro_batch)

    def _batches(self, step: int, skip: int) -> Iterator[list[int]]:
        last = self.plan.accumulation_steps - 1
        while self.end_step is None or step < self.end_step:
            for micro, batch in enumerate(self.indices_for_step(step)):
                if micro < skip:
                    continue
                # Moved before the yield: a batch handed out is consumed, as far as a
                # data loader's state is concerned (it accounts for its own prefetching).
                self._cursor = (step + 1, 0) if micro == last else (step, micro + 1)
                yield batch
            skip = 0
            step += 1

    def __len__(self) -> int:
        if self.end_step is None:
            raise TypeError("an ElasticBatchSampler without end_step is endless and has no len()")
        steps = self.end_step - self.start_step
        return steps * self.plan.accumulation_steps - self._start_micro_batch

    def state_dict(self) -> dict[str, Any]:
        """Where the newest iterator got: the next global step and its stream position.

        At a step boundary nothing in the state depends on the world size, the
        rank or the micro-batch limit, so a state saved by any rank loads on
        every rank of any world size. ``step`` is the step the next batch
        belongs to (completed optimizer steps, the checkpointer's ``step``) and
        ``position`` the stream position where it begins (the
        ``start_position`` of that step). A state taken in the middle of a step
        (some of this rank's micro-batches of it handed out) also says how the
        step was split, in ``within_step``; only the same split may resume it.

        Returns:
            A dict of plain ints (and ``within_step``: None or a dict of ints),
            loadable with ``torch.load(weights_only=True)``.
        """
        step, micro_batch = self._cursor
        within_step: dict[str, int] | None = None
        if micro_batch:
            within_step = {
                "micro_batch": micro_batch,
                "global_batch_size": self.plan.global_batch_size,
                "world_size": self.plan.world_size,
                "accumulation_steps": self.plan.accumulation_steps,
            }
        return {
            "format": SAMPLER_STATE_FORMAT,
            "version": _SAMPLER_STATE_VERSION,
            "step": step,
            "position": self.position_of(step),
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "within_step": within_step,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict` saved at any world size.

        The next ``iter()`` starts at the state's step and position, as a
        sampler created with ``start_step=state["step"]`` and
        ``start_position=state["position"]`` would; the global batch may differ
        from the one the state was saved with (the position carries on).

        Raises:
            BatchPlanError: naming the field, when the state is not a dict of
                this format and version, a field is missing, unknown, not an int
                or out of range, it is of another dataset size or seed, its step
                is past ``end_step``, or it was saved in the middle of a step
                that this sampler splits differently. Nothing changes then.
        """
        if not isinstance(state_dict, Mapping):
            raise BatchPlanError(
                f"an ElasticBatchSampler state must be a dict, not {type(state_dict).__name__}"
            )
        _check_keys("state", state_dict, _STATE_KEYS)
        if state_dict["format"] != SAMPLER_STATE_FORMAT:
            raise BatchPlanError(
                f"state['format'] ({state_dict['format']!r}) is not {SAMPLER_STATE_FORMAT!r}"
            )
        if state_dict["version"] != _SAMPLER_STATE_VERSION:
            raise BatchPlanError(
                f"state['version'] ({state_dict['version']!r}) is not {_SAMPLER_STATE_VERSION}"
            )
        step = _require_int("state['step']", state_dict["step"], minimum=0)
        position = _require_int("state['position']", state_dict["position"], minimum=0)
        for name in ("dataset_len", "seed"):
            saved = _require_int(f"state[{name!r}]", state_dict[name], minimum=0)
            if saved != getattr(self, name):
                raise BatchPlanError(
                    f"state[{name!r}] ({saved}) is not this sampler's {name} "
                    f"({getattr(self, name)}): the state is of another sample stream"
                )
        micro_batch = self._micro_batch_to_resume(state_dict["within_step"], step)
        # Mid-way through step end_step is past it too: that step never runs.
        if self.end_step is not None and (step, micro_batch) > (self.end_step, 0):
            raise BatchPlanError(f"state['step'] ({step}) is past end_step ({self.end_step})")
        self.start_step, self.start_position = step, position
        self._start_micro_batch = micro_batch
        self._cursor = (step, micro_batch)

    def _micro_batch_to_resume(self, within_step: object, step: int) -> int:
        """The micro-batches of ``step`` already consumed, checked against this split."""
        if within_step is None:
            return 0
        if not isinstance(within_step, Mapping):
            raise BatchPlanError(
                f"state['within_step'] must be None or a dict, not {type(within_step).__name__}"
            )
        _check_keys("state['within_step']", within_step, _WITHIN_STEP_KEYS)
        saved = {
            name: _require_int(f"state['within_step'][{name!r}]", within_step[name], minimum=1)
            for name in _WITHIN_STEP_KEYS
        }
        ours = {
            "global_batch_size": self.plan.global_batch_size,
            "world_size": self.plan.world_size,
            "accumulation_steps": self.plan.accumulation_steps,
        }
        differs = [f"{k} {saved[k]} (now {v})" for k, v in ours.items() if saved[k] != v]
        if differs:
            raise BatchPlanError(
                f"the state was saved in the middle of step {step} (after micro-batch "
                f"{saved['micro_batch']} of {saved['accumulation_steps']}), which only the "
                f"same split can resume, but {', '.join(differs)} differ: "
                "save the data loader's state at a step boundary to resume at another world size"
            )
        if saved["micro_batch"] >= saved["accumulation_steps"]:
            raise BatchPlanError(
                f"state['within_step']['micro_batch'] ({saved['micro_batch']}) must be less "
                f"than accumulation_steps ({saved['accumulation_steps']})"
            )
        return saved["micro_batch"]


def _check_keys(what: str, value: Mapping[str, Any], expected: tuple[str, ...]) -> None:
    """Refuse a state with a missing or an unknown field, naming it."""
    missing = [key for key in expected if key not in value]
    if missing:
        raise BatchPlanError(f"{what} has no {', '.join(map(repr, missing))}")
    unknown = [key for key in value if key not in expected]
    if unknown:
        raise BatchPlanError(f"{what} has unknown field(s) {', '.join(map(repr, unknown))}")


def scale_lr(
    base_lr: float,
    *,
    rule: str | None = None,
    world_size: int,
    base_world_size: int,
) -> float:
    """The learning rate for ``world_size`` under a declared resize rule.

    Only for jobs that let the global batch grow with the world size (a fixed
    per-worker batch) instead of keeping it constant, the default.

    Args:
        base_lr: the learning rate tuned at ``base_world_size``.
        rule: ``"none"`` (unchanged), ``"linear"`` (times ``world_size /
            base_world_size``) or ``"sqrt"`` (times its square root). ``None``:
            the job's ``TIDAL_RESIZE_POLICY``, else ``"none"``.
        world_size: the current world size.
        base_world_size: the world size ``base_lr`` was tuned for.

    Returns:
        The scaled learning rate.

    Raises:
        BatchPlanError: an unknown rule, or a world size that is not an int of
            at least 1.
    """
    _require_int("world_size", world_size, minimum=1)
    _require_int("base_world_size", base_world_size, minimum=1)
    source = "rule"
    if rule is None:
        rule = os.environ.get(RESIZE_POLICY_ENV, "none") or "none"
        source = RESIZE_POLICY_ENV
    if rule not in _LR_RULES:
        raise BatchPlanError(f"{source} ({rule!r}) is not one of {', '.join(_LR_RULES)}")
    ratio = world_size / base_world_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr
