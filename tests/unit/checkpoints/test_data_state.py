"""The sampler's saved position: round trip, resume at another world size, refusals.

``ElasticBatchSampler.state_dict()`` is what torchdata's ``StatefulDataLoader``
saves for it. The reference is the uninterrupted job: what every rank trains on
after a resume at any world size must be, step by step, the same global batch
as the job that never stopped, so the samples after the resume are exactly the
ones it had not yet consumed.
"""

from __future__ import annotations

import collections
import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import checkpoints as ck
from checkpoints.data import SAMPLER_STATE_FORMAT, BatchPlanError, ElasticBatchSampler

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the tests without it still run
    StatefulDataLoader = None

needs_torchdata = pytest.mark.skipif(
    StatefulDataLoader is None, reason="torchdata is not installed"
)
# torchdata 0.11 calls a torch function that torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

DATASET_LEN = 50
BATCH = 12
SEED = 5
END = 12  # steps: 144 samples, a little less than three epochs of 50


class IndexDataset(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def make(world_size: int, rank: int, **options: Any) -> ElasticBatchSampler:
    options = {"seed": SEED, "end_step": END, "max_local_batch": 3} | options
    return ElasticBatchSampler(
        dataset_len=DATASET_LEN,
        global_batch_size=BATCH,
        rank=rank,
        world_size=world_size,
        **options,
    )


def take(iterator: Any, count: int) -> list[list[int]]:
    return [list(map(int, next(iterator))) for _ in range(count)]


def steps_of(per_rank: list[list[list[int]]], passes: int) -> list[list[int]]:
    """Regroup ranks' micro-batches into global steps, ranks in order."""
    steps = len(per_rank[0]) // passes
    assert all(len(batches) == steps * passes for batches in per_rank)
    return [
        [
            i
            for batches in per_rank
            for micro in batches[k * passes : (k + 1) * passes]
            for i in micro
        ]
        for k in range(steps)
    ]


def uninterrupted(from_step: int) -> list[list[int]]:
    reference = make(1, 0)
    return [reference.global_indices(step) for step in range(from_step, END)]


def test_a_state_round_trips_into_a_fresh_sampler() -> None:
    sampler = make(2, 1)
    iterator = iter(sampler)
    take(iterator, 7)  # 3 steps of 2 micro-batches, and the first of step 3
    state = sampler.state_dict()
    assert state["step"] == 3
    assert state["position"] == 3 * BATCH
    rest = [list(b) for b in iterator]

    fresh = make(2, 1)
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict() == state
    assert len(fresh) == len(rest)
    assert [list(b) for b in fresh] == rest


def test_a_state_at_a_step_boundary_is_the_same_on_every_rank_and_world_size() -> None:
    states = []
    for world_size, max_local_batch in ((1, None), (2, 3), (3, 2), (4, 3)):
        for rank in range(world_size):
            sampler = make(world_size, rank, max_local_batch=max_local_batch)
            iterator = iter(sampler)
            take(iterator, 4 * sampler.plan.accumulation_steps)
            states.append(sampler.state_dict())
    assert all(state == states[0] for state in states)
    assert states[0] == {
        "format": SAMPLER_STATE_FORMAT,
        "version": 1,
        "step": 4,
        "position": 4 * BATCH,
        "dataset_len": DATASET_LEN,
        "seed": SEED,
        "within_step": None,
    }


def test_the_state_says_where_the_newest_iterator_is_from_iter_on() -> None:
    sampler = make(3, 0, start_step=2)
    assert sampler.state_dict()["step"] == 2
    iterator = iter(sampler)
    take(iterator, 4)
    assert sampler.state_dict()["step"] == 4
    iter(sampler)  # a new pass starts again at start_step, before its first batch
    assert sampler.state_dict()["step"] == 2
    assert [list(b) for b in iterator] == list(make(3, 0, start_step=4))
    assert sampler.state_dict()["step"] == END


def test_a_state_resumes_at_another_world_size_with_the_same_global_batches() -> None:
    # Saved mid-epoch at world size 3 (step 5 begins at position 60: epoch 1, offset 10).
    saved_at = 5
    savers = [make(3, rank) for rank in range(3)]
    before: list[list[list[int]]] = []
    for saver in savers:
        before.append(take(iter(saver), saved_at * saver.plan.accumulation_steps))
    state = savers[0].state_dict()
    assert all(saver.state_dict() == state for saver in savers)
    assert state["position"] // DATASET_LEN == 1
    seen_before = steps_of(before, savers[0].plan.accumulation_steps)
    assert seen_before == uninterrupted(0)[:saved_at]

    for world_size in (2, 4):
        resumed = []
        for rank in range(world_size):
            sampler = make(world_size, rank, max_local_batch=2)  # other micro-batches too
            sampler.load_state_dict(state)  # rank 0's state, as a checkpoint holds it
            resumed.append([list(b) for b in sampler])
        after = steps_of(resumed, make(world_size, 0, max_local_batch=2).plan.accumulation_steps)
        assert after == uninterrupted(saved_at), f"world size {world_size}"
        assert all(len(step) == BATCH for step in after)
        # The epoch in progress when saving: every sample exactly once, before or after.
        stream = [i for step in seen_before + after for i in step]
        assert sorted(stream[DATASET_LEN : 2 * DATASET_LEN]) == list(range(DATASET_LEN))
        counts = collections.Counter(stream[: 2 * DATASET_LEN])
        assert set(counts.values()) == {2}, "no repeats or skips in the first two epochs"


def test_a_state_saved_mid_step_resumes_only_with_the_same_split() -> None:
    sampler = make(3, 2)
    iterator = iter(sampler)
    take(iterator, 2 * 2 + 1)  # two steps, then the first of step 2's two micro-batches
    state = sampler.state_dict()
    assert state["step"] == 2
    assert state["within_step"] == {
        "micro_batch": 1,
        "global_batch_size": BATCH,
        "world_size": 3,
        "accumulation_steps": 2,
    }
    same = make(3, 2)
    same.load_state_dict(state)
    assert [list(b) for b in same] == [list(b) for b in iterator]

    for other in (make(2, 0), make(3, 0, max_local_batch=None)):
        with pytest.raises(BatchPlanError, match=r"middle of step 2 .*at a step boundary"):
            other.load_state_dict(state)


def test_a_loaded_state_carries_the_position_when_the_global_batch_changes() -> None:
    state = make(2, 0).state_dict() | {"step": 4, "position": 37}
    sampler = ElasticBatchSampler(
        dataset_len=DATASET_LEN, global_batch_size=8, rank=0, world_size=1, seed=SEED, end_step=6
    )
    sampler.load_state_dict(state)
    assert [list(b) for b in sampler] == [
        sampler.indices_at(37, 45),
        sampler.indices_at(45, 53),
    ]


def good_state() -> dict[str, Any]:
    sampler = make(2, 0)
    take(iter(sampler), 6)
    return sampler.state_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset_len": DATASET_LEN + 1}, r"state\['dataset_len'\] \(51\) is not this .* \(50\)"),
        ({"seed": SEED + 1}, r"state\['seed'\] \(6\) is not this sampler's seed \(5\)"),
        ({"step": -1}, r"state\['step'\] \(-1\) must be at least 0"),
        ({"step": True}, r"state\['step'\] \(True\) must be an int"),
        ({"step": "3"}, r"state\['step'\] \('3'\) must be an int"),
        ({"step": END + 1}, r"state\['step'\] \(13\) is past end_step \(12\)"),
        (
            {
                "step": END,
                "within_step": {
                    "micro_batch": 1,
                    "global_batch_size": BATCH,
                    "world_size": 2,
                    "accumulation_steps": 2,
                },
            },
            r"state\['step'\] \(12\) is past end_step \(12\)",
        ),
        ({"position": -12}, r"state\['position'\] \(-12\) must be at least 0"),
        ({"position": 3.0}, r"state\['position'\] \(3.0\) must be an int"),
        ({"format": "torch-sampler"}, r"state\['format'\] \('torch-sampler'\)"),
        ({"version": 2}, r"state\['version'\] \(2\) is not 1"),
        ({"epoch": 1}, r"state has unknown field\(s\) 'epoch'"),
        ({"within_step": [1]}, r"state\['within_step'\] must be None or a dict, not list"),
        (
            {"within_step": {"micro_batch": 1}},
            r"state\['within_step'\] has no 'global_batch_size', 'world_size', "
            r"'accumulation_steps'",
        ),
        (
            {
                "within_step": {
                    "micro_batch": 2,
                    "global_batch_size": BATCH,
                    "world_size": 2,
                    "accumulation_steps": 2,
                }
            },
            r"state\['within_step'\]\['micro_batch'\] \(2\) must be less than",
        ),
    ],
)
def test_a_bad_state_is_refused_naming_the_field_and_changes_nothing(
    change: dict[str, Any], message: str
) -> None:
    sampler = make(2, 0, start_step=1)
    before = sampler.state_dict()
    with pytest.raises(BatchPlanError, match=message):
        sampler.load_state_dict(good_state() | change)
    assert sampler.state_dict() == before
    assert len(sampler) == (END - 1) * 2


@pytest.mark.parametrize("missing", ["step", "position", "dataset_len", "seed", "within_step"])
def test_a_state_missing_a_field_is_refused_naming_it(missing: str) -> None:
    state = good_state()
    del state[missing]
    with pytest.raises(BatchPlanError, match=rf"state has no '{missing}'"):
        make(2, 0).load_state_dict(state)


def test_a_state_that_is_not_a_dict_is_refused() -> None:
    with pytest.raises(BatchPlanError, match="must be a dict, not list"):
        make(2, 0).load_state_dict([3, 36])  # type: ignore[arg-type]


def test_a_state_survives_torch_save_and_a_weights_only_load() -> None:
    state = good_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


# ----------------------------------------------------- torchdata's StatefulDataLoader


def stateful_loader(sampler: ElasticBatchSampler, num_workers: int) -> Any:
    return StatefulDataLoader(
        IndexDataset(DATASET_LEN), batch_sampler=sampler, num_workers=num_workers
    )


def through_torch_save(state: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@needs_torchdata
def test_a_stateful_dataloader_saved_at_world_size_3_resumes_at_2_and_4() -> None:
    # With worker processes: tests/integration/checkpoints/test_data_loader_workers.py.
    resumes_at_2_and_4(num_workers=0, shut_down=[])


def resumes_at_2_and_4(num_workers: int, shut_down: list[Any]) -> None:
    """Save a StatefulDataLoader's state at world size 3, resume it at 2 and 4; the iterators
    go into ``shut_down`` (their worker processes are stopped by whoever holds it)."""
    saved_at = 5
    savers = [make(3, rank) for rank in range(3)]
    passes = savers[0].plan.accumulation_steps
    before, after_same, states = [], [], []
    for saver in savers:
        loader = stateful_loader(saver, num_workers)
        iterator = iter(loader)
        shut_down.append(iterator)
        before.append(take(iterator, saved_at * passes))
        states.append(through_torch_save(loader.state_dict()))
        if num_workers:  # the workers prefetched: the sampler itself is ahead of training
            assert saver.state_dict()["step"] > saved_at
        after_same.append([list(map(int, b)) for b in iterator])  # the job not stopped
    assert steps_of(before, passes) == uninterrupted(0)[:saved_at]
    assert steps_of(after_same, passes) == uninterrupted(saved_at)

    for world_size in (2, 4):
        resumed = []
        for rank in range(world_size):
            loader = stateful_loader(make(world_size, rank), num_workers)
            loader.load_state_dict(states[0])  # rank 0's, as the checkpoint holds it
            iterator = iter(loader)
            shut_down.append(iterator)
            resumed.append([list(map(int, b)) for b in iterator])
        passes = make(world_size, 0).plan.accumulation_steps
        assert steps_of(resumed, passes) == uninterrupted(saved_at), f"world size {world_size}"


@needs_torchdata
def test_the_checkpointer_step_and_the_saved_loader_state_agree(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    sampler = make(2, 1)
    loader = stateful_loader(sampler, 0)
    with ck.Checkpointer(
        tmp_path,
        model=model,
        extra_state=lambda: {"loader": loader.state_dict()},
        every_steps=3,
        async_save=False,
        handle_sigterm=False,
    ) as ckpt:
        batches = iter(loader)
        for step in range(7):
            take(batches, sampler.plan.accumulation_steps)
            ckpt.maybe_save(step + 1)

    restored: dict[str, Any] = {}
    with ck.Checkpointer(
        tmp_path, model=model, load_extra_state=restored.update, handle_sigterm=False
    ) as ckpt:
        resume = ckpt.restore()
    assert resume.step == 6
    resampler = make(3, 0)  # resumed at another world size
    reloader = stateful_loader(resampler, 0)
    reloader.load_state_dict(restored["loader"])
    iterator = iter(reloader)
    assert resampler.state_dict()["step"] == resume.step
    assert [int(i) for i in next(iterator)] == resampler.indices_for_step(resume.step)[0]
