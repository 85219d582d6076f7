"""ElasticBatchSampler under torch's DataLoader with worker processes (num_workers=2): the
batches come in the sampler's order, an endless sampler is taken, the sampler runs ahead of
training, and torchdata's StatefulDataLoader saves and resumes across world sizes anyway.
The same without worker processes: tests/unit/checkpoints/test_data.py, test_data_state.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader

from checkpoints.data import ElasticBatchSampler
from tests.unit.checkpoints.test_data_state import (
    DATASET_LEN,
    IndexDataset,
    make,
    needs_torchdata,
    resumes_at_2_and_4,
    take,
)

# torchdata 0.11 calls a torch function that torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture
def shut_down() -> Iterator[list[Any]]:
    """Data loader iterators whose worker processes are stopped at teardown, even on failure."""
    iterators: list[Any] = []
    yield iterators
    for iterator in iterators:
        stop = getattr(iterator, "_shutdown_workers", None)
        if stop is not None:
            stop()


def test_a_dataloader_with_workers_takes_an_endless_sampler(shut_down: list[Any]) -> None:
    sampler = ElasticBatchSampler(dataset_len=10, global_batch_size=4, rank=0, world_size=2)
    loader = iter(DataLoader(IndexDataset(10), batch_sampler=sampler, num_workers=2))
    shut_down.append(loader)
    delivered = [next(loader).tolist() for _ in range(12)]
    assert delivered == [sampler.indices_for_step(step)[0] for step in range(12)]


def test_a_dataloader_with_worker_processes_delivers_the_sampler_batches_in_order() -> None:
    def sampler() -> ElasticBatchSampler:
        return ElasticBatchSampler(
            dataset_len=50,
            global_batch_size=12,
            rank=1,
            world_size=3,
            seed=11,
            start_step=2,
            end_step=12,
            max_local_batch=3,
        )

    loader = DataLoader(IndexDataset(50), batch_sampler=sampler(), num_workers=2)
    delivered = [batch.tolist() for batch in loader]
    assert delivered == list(sampler())
    assert len(loader) == 10 * 2  # ten steps of two micro-batches (4 samples, at most 3 a pass)


def test_with_a_plain_dataloader_the_sampler_runs_ahead_of_training(
    shut_down: list[Any],
) -> None:
    # Worker processes prefetch, so the sampler's own state is ahead of what
    # training consumed: with a plain DataLoader the position comes from the
    # checkpoint's step (start_step=resume.step), never from the sampler's state.
    sampler = make(2, 0)
    loader = iter(DataLoader(IndexDataset(DATASET_LEN), batch_sampler=sampler, num_workers=2))
    shut_down.append(loader)
    take(loader, 2)  # step 1 consumed
    assert sampler.state_dict()["step"] > 1


@needs_torchdata
def test_a_stateful_dataloader_with_workers_saved_at_world_size_3_resumes_at_2_and_4(
    shut_down: list[Any],
) -> None:
    resumes_at_2_and_4(num_workers=2, shut_down=shut_down)
