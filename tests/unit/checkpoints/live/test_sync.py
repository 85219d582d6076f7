"""The state sync of a live resize (checkpoints.live.sync): a state splits into a plain
skeleton and its tensors and back; a single rank sends nothing."""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import torch

from checkpoints.live import sync_state
from checkpoints.live.sync import _fill, _slots, _split


class Pair(NamedTuple):
    a: Any
    b: Any


def test_a_state_splits_into_a_plain_skeleton_and_its_tensors_and_back() -> None:
    state: dict[str, Any] = {
        "step": 7,
        "rng": {"torch": torch.arange(5, dtype=torch.uint8), "python": (3, (1, 2), None)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2, 3).t()}}, "param_groups": [{}]},
        "extra": [Pair(torch.tensor(1.5), "x")],
    }
    tensors: list[torch.Tensor] = []
    skeleton = _split(state, tensors)
    assert len(tensors) == 3 and all(t.is_contiguous() for t in tensors)
    assert [slot.shape for slot in _slots(skeleton)] == [(5,), (3, 2), ()]
    skeleton = pickle.loads(pickle.dumps(skeleton))  # what broadcast_object_list does
    back = _fill(skeleton, [t.clone() for t in tensors])
    assert back["step"] == 7 and back["rng"]["python"] == (3, (1, 2), None)
    assert isinstance(back["extra"][0], Pair) and back["extra"][0].b == "x"
    torch.testing.assert_close(back["optimizer"]["state"][0]["exp_avg"], torch.ones(3, 2))
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])


def test_a_single_rank_keeps_its_own_state() -> None:
    def capture() -> dict[str, Any]:
        raise AssertionError("nothing is sent with a single rank")

    got = sync_state(live_step=4, group=None, model=torch.nn.Linear(2, 2), capture=capture)
    assert (got.step, got.state) == (4, None)
