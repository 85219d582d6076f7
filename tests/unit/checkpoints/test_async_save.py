"""The snapshot's reused buffers: values, re-allocation, the hold while a save is in flight."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoints as ck
import checkpoints.checkpointer as checkpointer_module
import checkpoints.saving as saving_module
from checkpoints.async_save import StateSnapshot
from checkpoints.errors import CheckpointStateError, CheckpointWriteError
from checkpoints.restoring import read_replicated


def test_the_snapshot_reuses_its_buffers_and_copies_values() -> None:
    snapshot = StateSnapshot()
    source = {
        "a": torch.ones(3),
        "b": [torch.zeros(2, 2, dtype=torch.float64), 7],
        "c": torch.ones(()),
    }
    first = snapshot.take(source)
    pointer = first["a"].data_ptr()
    snapshot.release()
    source["a"].add_(1)
    second = snapshot.take(source)
    assert second["a"].data_ptr() == pointer  # same buffer, no new allocation
    assert torch.equal(second["a"], torch.full((3,), 2.0))
    assert second["b"][1] == 7 and second["b"][0].shape == (2, 2) and second["c"].shape == ()
    assert second["a"].data_ptr() != source["a"].data_ptr()  # a copy, not the live tensor
    # One buffer per dtype: float32 tensors share a storage.
    assert second["a"].untyped_storage().data_ptr() == second["c"].untyped_storage().data_ptr()


def test_a_held_snapshot_is_not_overwritten_until_it_is_released() -> None:
    snapshot = StateSnapshot()
    live = {"w": torch.arange(4.0)}
    in_flight = snapshot.take(live)
    live["w"].mul_(10)  # training goes on while the writer reads the snapshot
    with pytest.raises(RuntimeError, match="save in flight"):
        snapshot.take(live)
    assert snapshot.held
    assert torch.equal(in_flight["w"], torch.arange(4.0))  # the save in flight is intact
    snapshot.release()
    assert not snapshot.held
    assert torch.equal(snapshot.take(live)["w"], torch.arange(4.0) * 10)


def test_a_refused_tree_leaves_the_snapshot_free() -> None:
    snapshot = StateSnapshot()
    with pytest.raises(CheckpointStateError, match="is a set"):
        snapshot.take({"bad": {1}})
    assert not snapshot.held
    assert torch.equal(snapshot.take({"w": torch.ones(2)})["w"], torch.ones(2))


def test_the_buffers_follow_the_state_when_its_sizes_dtypes_or_shapes_change() -> None:
    snapshot = StateSnapshot()
    model = {"w": torch.ones(2, 3)}
    pointer = snapshot.take(model)["w"].data_ptr()
    snapshot.release()
    # Same sizes, another shape: the buffer is reused, the shape is the new one.
    reshaped = snapshot.take({"w": torch.full((3, 2), 2.0)})
    assert reshaped["w"].shape == (3, 2) and reshaped["w"].data_ptr() == pointer
    assert torch.equal(reshaped["w"], torch.full((3, 2), 2.0))
    snapshot.release()
    # New tensors (an optimizer's moments appear after its first step): new buffers.
    grown = snapshot.take({"w": torch.ones(2, 3), "m": torch.arange(5.0)})
    assert torch.equal(grown["w"], torch.ones(2, 3)) and torch.equal(grown["m"], torch.arange(5.0))
    assert snapshot.nbytes == (6 + 5) * 4
    snapshot.release()
    # Another dtype: a buffer of that dtype.
    cast = snapshot.take({"w": torch.ones(2, 3, dtype=torch.float64), "m": torch.arange(5.0)})
    assert cast["w"].dtype == torch.float64 and torch.equal(cast["w"], torch.ones(2, 3).double())
    assert torch.equal(cast["m"], torch.arange(5.0))


def test_non_contiguous_tensors_are_copied_with_their_shape() -> None:
    snapshot = StateSnapshot()
    base = torch.arange(12.0).reshape(3, 4)
    taken = snapshot.take({"t": base.t(), "every_other": base[:, ::2]})
    assert torch.equal(taken["t"], base.t()) and taken["t"].is_contiguous()
    assert torch.equal(taken["every_other"], base[:, ::2])


def test_prepared_buffers_are_the_ones_the_first_take_fills() -> None:
    snapshot = StateSnapshot()
    tree = {"w": torch.randn(3, 4), "n": torch.arange(5), "step": 7}
    job = snapshot.prepare(tree)
    assert job is not None and snapshot.nbytes == 0  # nothing allocated on this thread
    job()
    assert snapshot.nbytes == 12 * 4 + 5 * 8 and not snapshot.held
    prepared = {b.data_ptr() for b in snapshot._buffers}
    taken = snapshot.take(tree)
    assert {taken["w"].data_ptr(), taken["n"].data_ptr()} == prepared  # no new allocation
    assert torch.equal(taken["w"], tree["w"]) and torch.equal(taken["n"], tree["n"])
    assert snapshot.prepare(tree) is None  # in use, and the same layout: nothing to do
    snapshot.release()
    assert snapshot.prepare(tree) is None  # the buffers already fit


def test_a_prepare_job_never_replaces_buffers_in_use() -> None:
    snapshot = StateSnapshot()
    in_flight = snapshot.take({"w": torch.ones(2)})
    pointer = in_flight["w"].data_ptr()
    job = snapshot.prepare({"w": torch.ones(2), "m": torch.ones(3)})  # a new layout
    assert job is not None
    job()  # finds the snapshot held: drops what it built
    assert snapshot._buffers[0].data_ptr() == pointer and snapshot.nbytes == 2 * 4
    assert torch.equal(in_flight["w"], torch.ones(2)) and snapshot.held


def test_a_take_that_comes_before_the_prepare_job_keeps_its_own_buffers() -> None:
    snapshot = StateSnapshot()
    tree = {"w": torch.arange(3.0)}
    job = snapshot.prepare(tree)
    assert job is not None
    taken = snapshot.take(tree)  # the first save came before the job ran
    snapshot.release()
    job()
    again = snapshot.take(tree)
    assert again["w"].data_ptr() == taken["w"].data_ptr()
    assert torch.equal(again["w"], torch.arange(3.0))


def test_state_that_cannot_be_checkpointed_is_refused_by_prepare_too() -> None:
    with pytest.raises(CheckpointStateError, match="is a set"):
        StateSnapshot().prepare({"bad": {1}})


class _Net:
    """A small model and optimizer that train deterministically."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model(torch.randn(5, 4)).pow(2).mean().backward()
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def test_a_save_in_flight_keeps_its_values_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    written: list[Any] = []
    real_write = saving_module.write_replicated

    def slow_write(store: Any, tree: Any, **kwargs: Any) -> Any:
        written.append(tree)
        assert release.wait(30), "the test never released the writer"
        return real_write(store, tree, **kwargs)

    monkeypatch.setattr(saving_module, "write_replicated", slow_write)
    net = _Net()
    ckpt = ck.Checkpointer(tmp_path, model=net.model, optimizer=net.optimizer, handle_sigterm=False)
    net.step()
    ckpt.save(1)  # the writer now holds the snapshot of step 1
    at_step_1 = net.weights()
    for _ in range(3):
        net.step()  # the live weights move on, the snapshot must not
    threading.Timer(0.2, release.set).start()
    ckpt.save(4)  # waits for the save of step 1, then reuses its buffers
    ckpt.close()
    first, second = written
    assert first["model"]["weight"].data_ptr() == second["model"]["weight"].data_ptr()
    assert not torch.equal(at_step_1["weight"], net.weights()["weight"])
    for step, expected in [(1, at_step_1), (4, net.weights())]:
        _, state = read_replicated(ckpt._store, tmp_path / f"step-{step:010d}", mmap=False)
        torch.testing.assert_close(state["model"], expected, rtol=0, atol=0)


def test_a_failed_write_releases_the_snapshot_for_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = saving_module.write_replicated
    failures = [CheckpointWriteError("disk full (injected)")]

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real_write(*args, **kwargs)

    monkeypatch.setattr(saving_module, "write_replicated", failing_once)
    net = _Net()
    ckpt = ck.Checkpointer(tmp_path, model=net.model, optimizer=net.optimizer, handle_sigterm=False)
    net.step()
    ckpt.save(1)
    ckpt._saver.writer.wait()
    assert not ckpt._saver.snapshot.held
    net.step()
    ckpt.save(2)
    ckpt.close()
    assert [s.error is None for s in ckpt.saves] == [False, True]
    with ck.Checkpointer(tmp_path, model=_Net().model, handle_sigterm=False) as survivor:
        assert survivor.restore().step == 2


def _capture_writes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    written: list[Any] = []
    real_write = saving_module.write_replicated

    def capturing(store: Any, tree: Any, **kwargs: Any) -> Any:
        written.append(tree)
        return real_write(store, tree, **kwargs)

    monkeypatch.setattr(saving_module, "write_replicated", capturing)
    return written


def test_the_first_save_finds_its_buffers_prepared_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = _capture_writes(monkeypatch)
    net = _Net()
    ckpt = ck.Checkpointer(
        tmp_path, model=net.model, optimizer=net.optimizer, every_steps=3, handle_sigterm=False
    )
    net.step()
    assert not ckpt.maybe_save(1)  # not due: a background thread prepares the buffers
    assert ckpt._saver.preparing is not None
    ckpt._saver.preparing.join(30)
    assert ckpt._saver.snapshot.nbytes == (3 * (4 * 3 + 3) + 2) * 4  # weights, 2 moments, 2 steps
    prepared = {b.data_ptr() for b in ckpt._saver.snapshot._buffers}
    net.step()
    ckpt.maybe_save(2)
    net.step()
    assert ckpt.maybe_save(3)
    ckpt.close()
    (tree,) = written
    assert tree["model"]["weight"].untyped_storage().data_ptr() in prepared
    torch.testing.assert_close(tree["model"], net.weights(), rtol=0, atol=0)


def test_nothing_is_prepared_when_checkpointing_is_off(tmp_path: Path) -> None:
    net = _Net()
    ckpt = ck.Checkpointer(tmp_path, model=net.model, optimizer=net.optimizer, handle_sigterm=False)
    for step in range(1, 4):
        net.step()
        ckpt.maybe_save(step)
    assert ckpt._saver.snapshot.nbytes == 0 and not ckpt._saver.writer.busy
    ckpt.close()


def test_buffers_are_prepared_without_optimizer_state_after_a_few_calls(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state, ever
    ckpt = ck.Checkpointer(
        tmp_path, model=model, optimizer=optimizer, every_steps=1000, handle_sigterm=False
    )
    calls = 0
    while ckpt._saver.preparing is None and calls < 100:
        calls += 1
        ckpt.maybe_save(calls)
    assert calls == checkpointer_module._PREPARE_CALLS
    ckpt._saver.preparing.join(30)
    assert ckpt._saver.snapshot.nbytes == (12 + 3) * 4
    ckpt.close()


def test_a_save_due_while_the_buffers_are_prepared_neither_waits_nor_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = _Net()
    ckpt = ck.Checkpointer(
        tmp_path, model=net.model, optimizer=net.optimizer, every_steps=2, handle_sigterm=False
    )
    release = threading.Event()
    real_prepare = ckpt._saver.snapshot.prepare

    def slow_prepare(tree: Any) -> Any:
        job = real_prepare(tree)

        def slow_job() -> None:
            assert release.wait(30), "the test never released the preparation"
            job()

        return slow_job

    monkeypatch.setattr(ckpt._saver.snapshot, "prepare", slow_prepare)
    net.step()
    ckpt.maybe_save(1)
    assert ckpt._saver.preparing is not None and ckpt._saver.preparing.is_alive()
    net.step()
    assert ckpt.maybe_save(2)  # due: allocates its own buffers, does not wait
    ckpt._saver.writer.wait()
    pointer = ckpt._saver.snapshot._buffers[0].data_ptr()
    release.set()
    ckpt._saver.preparing.join(30)
    assert ckpt._saver.snapshot._buffers[0].data_ptr() == pointer  # the late job changed nothing
    net.step()
    ckpt.maybe_save(3)
    net.step()
    assert ckpt.maybe_save(4)
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["step-0000000002", "step-0000000004"]
