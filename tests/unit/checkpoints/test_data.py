"""The elastic data position and batch plan: exact resume at any world size.

The reference everywhere is written out independently of the code under test:
the sample stream is epoch 0's permutation, then epoch 1's, ... each drawn by
``torch.randperm`` seeded with ``seed + epoch``, and global step ``s`` is stream
positions ``[s*B, (s+1)*B)``. A job cut into segments at arbitrary steps, each
at its own world size (and micro-batch limit), must consume exactly that.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints.data import (
    RESIZE_POLICY_ENV,
    BatchPlan,
    BatchPlanError,
    ElasticBatchSampler,
    scale_lr,
)
from checkpoints.errors import CheckpointError


def reference_stream(dataset_len: int, seed: int, length: int) -> list[int]:
    """The first ``length`` positions of the sample stream, built from first principles."""
    stream: list[int] = []
    epoch = 0
    while len(stream) < length:
        generator = torch.Generator().manual_seed(seed + epoch)
        stream.extend(torch.randperm(dataset_len, generator=generator).tolist())
        epoch += 1
    return stream[:length]


def consume_segment(
    *,
    dataset_len: int,
    global_batch_size: int,
    world_size: int,
    seed: int,
    start_step: int,
    end_step: int,
    max_local_batch: int | None,
    start_position: int | None = None,
) -> list[list[int]]:
    """What a segment of the job trains on: per global step, the ranks' samples in rank order."""
    per_rank_steps: list[list[list[int]]] = []
    for rank in range(world_size):
        sampler = ElasticBatchSampler(
            dataset_len=dataset_len,
            global_batch_size=global_batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
            start_step=start_step,
            max_local_batch=max_local_batch,
            end_step=end_step,
            start_position=start_position,
        )
        batches = list(sampler)
        assert len(batches) == len(sampler)
        per_step = sampler.plan.accumulation_steps
        steps = [
            [i for micro in batches[k : k + per_step] for i in micro]
            for k in range(0, len(batches), per_step)
        ]
        assert len(steps) == end_step - start_step
        per_rank_steps.append(steps)
    return [
        [i for rank in range(world_size) for i in per_rank_steps[rank][step]]
        for step in range(end_step - start_step)
    ]


segment_st = st.tuples(
    st.integers(min_value=1, max_value=5),  # world size (capped at B below)
    st.integers(min_value=0, max_value=7),  # steps in the segment
    # max_local_batch (1 is only possible with an even split: see the tests below)
    st.one_of(st.none(), st.integers(min_value=2, max_value=6)),
)


@settings(max_examples=150, deadline=None)
@given(
    dataset_len=st.integers(min_value=1, max_value=40),
    global_batch_size=st.integers(min_value=1, max_value=24),
    seed=st.integers(min_value=0, max_value=2**31),
    segments=st.lists(segment_st, min_size=1, max_size=5),
)
def test_a_job_resumed_at_any_world_sizes_consumes_exactly_the_uninterrupted_stream(
    dataset_len: int,
    global_batch_size: int,
    seed: int,
    segments: list[tuple[int, int, int | None]],
) -> None:
    consumed: list[list[int]] = []
    step = 0
    for world_size, steps, max_local_batch in segments:
        consumed += consume_segment(
            dataset_len=dataset_len,
            global_batch_size=global_batch_size,
            world_size=min(world_size, global_batch_size),
            seed=seed,
            start_step=step,
            end_step=step + steps,
            max_local_batch=max_local_batch,
        )
        step += steps

    flat = [i for batch in consumed for i in batch]
    expected = reference_stream(dataset_len, seed, step * global_batch_size)
    assert flat == expected
    # No repeats and no skips within an epoch: every complete epoch is a permutation.
    for start in range(0, len(flat) - dataset_len + 1, dataset_len):
        assert sorted(flat[start : start + dataset_len]) == list(range(dataset_len))


@settings(max_examples=100, deadline=None)
@given(
    dataset_len=st.integers(min_value=1, max_value=30),
    seed=st.integers(min_value=0, max_value=2**31),
    segments=st.lists(
        st.tuples(st.integers(min_value=1, max_value=4), st.integers(min_value=1, max_value=6)),
        min_size=1,
        max_size=4,
    ),
)
def test_a_job_whose_global_batch_changes_continues_the_stream_from_its_sample_count(
    dataset_len: int, seed: int, segments: list[tuple[int, int]]
) -> None:
    # A fixed per-worker batch of 3: the global batch grows and shrinks with W, and
    # each segment starts from the number of samples consumed so far.
    consumed: list[list[int]] = []
    step = 0
    for world_size, steps in segments:
        consumed += consume_segment(
            dataset_len=dataset_len,
            global_batch_size=3 * world_size,
            world_size=world_size,
            seed=seed,
            start_step=step,
            end_step=step + steps,
            max_local_batch=None,
            start_position=sum(len(batch) for batch in consumed),
        )
        step += steps
    flat = [i for batch in consumed for i in batch]
    assert flat == reference_stream(dataset_len, seed, len(flat))


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(min_value=1, max_value=16),
    extra=st.integers(min_value=0, max_value=100),
    max_local_batch=st.one_of(st.none(), st.integers(min_value=2, max_value=12)),
)
def test_uneven_slices_cover_the_global_batch_exactly_once_in_rank_order(
    world_size: int, extra: int, max_local_batch: int | None
) -> None:
    global_batch_size = world_size + extra
    plans = [
        BatchPlan.create(
            global_batch_size=global_batch_size,
            world_size=world_size,
            rank=rank,
            max_local_batch=max_local_batch,
        )
        for rank in range(world_size)
    ]
    covered = [p for plan in plans for p in range(global_batch_size)[plan.local_slice]]
    assert covered == list(range(global_batch_size))
    sizes = [plan.local_batch_size for plan in plans]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger shares come first
    for plan in plans:
        assert plan.loss_scale == world_size / global_batch_size
        assert sum(plan.micro_batches) == plan.local_batch_size
        assert min(plan.micro_batches) >= 1
        assert plan.accumulation_steps == len(plan.micro_batches)
        if max_local_batch is None:
            assert plan.micro_batches == (plan.local_batch_size,)
        else:
            assert max(plan.micro_batches) <= max_local_batch
            # Every rank runs as many passes as the largest share needs, the fewest
            # that respect the limit, with sizes within one of each other.
            largest = math.ceil(global_batch_size / world_size)
            assert plan.accumulation_steps == math.ceil(largest / max_local_batch)
            assert max(plan.micro_batches) - min(plan.micro_batches) <= 1


def ddp_gradient(
    model: torch.nn.Linear,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    world_size: int,
    max_local_batch: int | None,
) -> list[torch.Tensor]:
    """What DDP hands the optimizer: the ranks' accumulated gradients, averaged over ranks."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(world_size):
        plan = BatchPlan.create(
            global_batch_size=len(x),
            world_size=world_size,
            rank=rank,
            max_local_batch=max_local_batch,
        )
        model.zero_grad()
        start = plan.local_offset
        for size in plan.micro_batches:
            xs, ys = x[start : start + size], y[start : start + size]
            per_sample = ((model(xs) - ys) ** 2).sum(dim=1)
            (per_sample.sum() * plan.loss_scale).backward()
            start += size
        for acc, p in zip(total, model.parameters(), strict=True):
            assert p.grad is not None
            acc += p.grad
    return [acc / world_size for acc in total]


@settings(max_examples=100, deadline=None)
@given(
    world_size=st.integers(min_value=1, max_value=7),
    extra=st.integers(min_value=0, max_value=30),
    max_local_batch=st.one_of(st.none(), st.integers(min_value=2, max_value=5)),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_loss_scale_makes_the_rank_averaged_gradient_the_global_mean_gradient(
    world_size: int, extra: int, max_local_batch: int | None, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    global_batch_size = world_size + extra
    x = torch.randn(global_batch_size, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(global_batch_size, 2, generator=generator, dtype=torch.float64)
    model = torch.nn.Linear(3, 2, dtype=torch.float64)

    model.zero_grad()
    ((model(x) - y) ** 2).sum(dim=1).mean().backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    got = ddp_gradient(model, x, y, world_size=world_size, max_local_batch=max_local_batch)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_one_sample_per_pass_works_when_the_batch_splits_evenly() -> None:
    plans = [
        BatchPlan.create(global_batch_size=6, world_size=3, rank=r, max_local_batch=1)
        for r in range(3)
    ]
    assert [p.micro_batches for p in plans] == [(1, 1)] * 3


def test_one_sample_per_pass_with_an_uneven_split_is_refused_as_ranks_would_differ() -> None:
    # Shares 2, 2, 1: ranks 0 and 1 need two passes, rank 2 could run only one.
    for rank in range(3):
        with pytest.raises(BatchPlanError, match=r"max_local_batch \(1\) needs 2 passes.*only 1"):
            BatchPlan.create(global_batch_size=5, world_size=3, rank=rank, max_local_batch=1)


def test_the_same_seed_gives_the_same_order_and_another_seed_another() -> None:
    def first_steps(seed: int) -> list[int]:
        sampler = ElasticBatchSampler(
            dataset_len=1000, global_batch_size=10, rank=0, world_size=1, seed=seed, end_step=5
        )
        return [i for batch in sampler for i in batch]

    assert first_steps(7) == first_steps(7)
    assert first_steps(7) != first_steps(8)


def test_global_indices_of_a_step_are_the_ranks_slices_in_rank_order() -> None:
    samplers = [
        ElasticBatchSampler(
            dataset_len=13, global_batch_size=8, rank=rank, world_size=3, seed=3, start_step=4
        )
        for rank in range(3)
    ]
    for step in range(4, 9):
        joined = [i for s in samplers for micro in s.indices_for_step(step) for i in micro]
        assert joined == samplers[0].global_indices(step)
        assert samplers[0].epoch_of(step) == step * 8 // 13


def test_a_step_before_the_start_of_the_stream_is_refused() -> None:
    sampler = ElasticBatchSampler(
        dataset_len=10, global_batch_size=4, rank=0, world_size=1, start_step=5, start_position=6
    )
    assert sampler.position_of(4) == 2
    with pytest.raises(BatchPlanError, match=r"step \(3\) would begin before the start"):
        sampler.global_indices(3)


def test_an_endless_sampler_keeps_going_and_has_no_len() -> None:
    sampler = ElasticBatchSampler(dataset_len=5, global_batch_size=3, rank=1, world_size=2)
    iterator = iter(sampler)
    batches = [next(iterator) for _ in range(100)]
    assert all(len(b) == 1 for b in batches)
    with pytest.raises(TypeError, match="endless"):
        len(sampler)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 2, "world_size": 3, "rank": 0}, r"global_batch_size \(2\).*\(3\)"),
        ({"global_batch_size": 0, "world_size": 1, "rank": 0}, r"global_batch_size \(0\)"),
        ({"global_batch_size": -4, "world_size": 1, "rank": 0}, r"global_batch_size \(-4\)"),
        ({"global_batch_size": 8, "world_size": 0, "rank": 0}, r"world_size \(0\)"),
        ({"global_batch_size": 8, "world_size": 2, "rank": 2}, r"rank \(2\).*world_size \(2\)"),
        ({"global_batch_size": 8, "world_size": 2, "rank": -1}, r"rank \(-1\)"),
        (
            {"global_batch_size": 8, "world_size": 2, "rank": 0, "max_local_batch": 0},
            r"max_local_batch \(0\)",
        ),
    ],
)
def test_a_plan_that_makes_no_sense_is_refused_naming_the_values(
    kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(BatchPlanError, match=message):
        BatchPlan.create(**kwargs)


def test_the_refusals_are_checkpoint_errors_and_value_errors() -> None:
    assert issubclass(BatchPlanError, CheckpointError)
    assert issubclass(BatchPlanError, ValueError)


def test_non_integer_sizes_are_refused() -> None:
    with pytest.raises(BatchPlanError, match=r"global_batch_size \(8.0\)"):
        BatchPlan.create(global_batch_size=8.0, world_size=2, rank=0)  # type: ignore[arg-type]
    with pytest.raises(BatchPlanError, match=r"world_size \(True\)"):
        BatchPlan.create(global_batch_size=8, world_size=True, rank=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset_len": 0}, r"dataset_len \(0\)"),
        ({"start_step": -1}, r"start_step \(-1\)"),
        ({"start_position": -3}, r"start_position \(-3\)"),
        ({"start_step": 5, "end_step": 4}, r"end_step \(4\) is before start_step \(5\)"),
        ({"world_size": 9}, r"global_batch_size \(8\).*world_size \(9\)"),
    ],
)
def test_a_sampler_that_makes_no_sense_is_refused_naming_the_values(
    kwargs: dict[str, int], message: str
) -> None:
    args = {"dataset_len": 10, "global_batch_size": 8, "rank": 0, "world_size": 2} | kwargs
    with pytest.raises(BatchPlanError, match=message):
        ElasticBatchSampler(**args)


def test_scale_lr_applies_the_declared_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESIZE_POLICY_ENV, raising=False)
    assert scale_lr(0.1, world_size=4, base_world_size=2) == 0.1
    assert scale_lr(0.1, rule="none", world_size=4, base_world_size=2) == 0.1
    assert scale_lr(0.1, rule="linear", world_size=4, base_world_size=2) == pytest.approx(0.2)
    assert scale_lr(0.1, rule="sqrt", world_size=8, base_world_size=2) == pytest.approx(0.2)
    assert scale_lr(0.1, rule="linear", world_size=1, base_world_size=4) == pytest.approx(0.025)


def test_scale_lr_takes_the_jobs_policy_from_the_environment_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(RESIZE_POLICY_ENV, "linear")
    assert scale_lr(0.1, world_size=3, base_world_size=1) == pytest.approx(0.3)
    assert scale_lr(0.1, rule="none", world_size=3, base_world_size=1) == 0.1
    monkeypatch.setenv(RESIZE_POLICY_ENV, "cubic")
    with pytest.raises(BatchPlanError, match=r"TIDAL_RESIZE_POLICY \('cubic'\)"):
        scale_lr(0.1, world_size=3, base_world_size=1)


def test_scale_lr_refuses_unknown_rules_and_empty_worlds() -> None:
    with pytest.raises(BatchPlanError, match=r"rule \('square'\)"):
        scale_lr(0.1, rule="square", world_size=2, base_world_size=1)
    with pytest.raises(BatchPlanError, match=r"world_size \(0\)"):
        scale_lr(0.1, rule="linear", world_size=0, base_world_size=1)
    with pytest.raises(BatchPlanError, match=r"base_world_size \(0\)"):
        scale_lr(0.1, rule="linear", world_size=2, base_world_size=0)
