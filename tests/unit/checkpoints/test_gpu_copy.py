"""checkpoints.gpu_copy and its use by the snapshot and the checkpointer: off the training stream.

The decision, the hook and the buffers' reuse are tested on the CPU (the
side-stream path's plumbing runs there too, its copies being CPU copies);
the tests marked ``cuda`` check on a GPU that a save does not wait for its
copy and that a checkpoint holds the state of its step while training goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoints as ck
import checkpoints.async_save as async_save
import checkpoints.saving as saving_module
from checkpoints.async_save import StateSnapshot
from checkpoints.gpu_copy import CopyPath, SideStreamCopy, copy_path, stable_tensors
from checkpoints.restoring import read_replicated
from checkpoints.storage import CheckpointStore

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def model_and_optimizer(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


# ------------------------------------------------------------------ the decision


@pytest.mark.parametrize(
    ("devices", "guarded", "cuda", "path"),
    [
        ([CPU, CPU], True, True, CopyPath.HOST),
        ([], True, True, CopyPath.HOST),
        ([CPU, GPU0], True, True, CopyPath.SIDE_STREAM),
        ([GPU0, GPU0], True, True, CopyPath.SIDE_STREAM),
        ([GPU0], False, True, CopyPath.WAIT),  # no optimizer says when parameters change
        ([GPU0, GPU1], True, True, CopyPath.WAIT),  # one side stream serves one device
        ([GPU0], True, False, CopyPath.WAIT),
        ([torch.device("mps")], True, True, CopyPath.WAIT),
    ],
)
def test_the_copy_path_follows_the_devices_the_optimizer_and_cuda(
    devices: list[torch.device], guarded: bool, cuda: bool, path: CopyPath
) -> None:
    assert copy_path(devices, guarded=guarded, cuda_available=cuda) is path


def test_cpu_state_takes_the_host_path_and_registers_no_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    orders = _count_orders(monkeypatch)
    model, optimizer = model_and_optimizer("cpu")
    snapshot = StateSnapshot(model=model, optimizer=optimizer)
    snapshot.take(model.state_dict())
    assert snapshot.path is CopyPath.HOST
    optimizer.step()
    assert orders == []  # no hook
    snapshot.release()
    snapshot.close()


# ------------------------------------------------------------------ SideStreamCopy


def test_cpu_tensors_are_copied_at_once() -> None:
    copier = SideStreamCopy()
    sources = [torch.arange(4.0), torch.ones(2, 2, dtype=torch.int64)]
    targets = [torch.empty(4), torch.empty(2, 2, dtype=torch.int64)]
    copier.start(sources, targets)
    assert not copier.pending
    assert all(torch.equal(s, t) for s, t in zip(sources, targets, strict=True))


def test_sources_and_targets_must_pair() -> None:
    with pytest.raises(ValueError, match="1 sources but 2 targets"):
        SideStreamCopy().start([torch.ones(1)], [torch.ones(1), torch.ones(1)])


def test_stable_tensors_are_parameters_and_optimizer_state_not_buffers() -> None:
    model, optimizer = model_and_optimizer("cpu")
    stable = stable_tensors(model, optimizer)
    assert model[0].weight.data_ptr() in stable
    assert optimizer.state[model[0].weight]["exp_avg"].data_ptr() in stable
    assert model[1].running_mean.data_ptr() not in stable
    assert stable_tensors(None, optimizer) == stable  # the optimizer knows the parameters


def test_a_trainable_parameter_outside_the_optimizer_is_not_stable_a_frozen_one_is() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[2].requires_grad_(False)
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)  # model[1]: another optimizer's
    stable = stable_tensors(model, optimizer)
    assert model[0].weight.data_ptr() in stable and model[2].weight.data_ptr() in stable
    assert model[1].weight.data_ptr() not in stable


def test_the_guard_orders_each_optimizer_step_after_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    orders = _count_orders(monkeypatch)
    _, optimizer = model_and_optimizer("cpu")
    handle = SideStreamCopy().guard(optimizer)
    optimizer.step()
    optimizer.step()
    handle.remove()
    optimizer.step()
    assert len(orders) == 2


def test_ordering_the_step_without_a_copy_in_flight_does_nothing() -> None:
    copier = SideStreamCopy()
    copier.order_step()  # on a machine without CUDA: touches no CUDA API
    copier.wait()
    assert not copier.pending


class _SlowEvent:
    """Stands for a CUDA event whose copies finish when the test says so."""

    def __init__(self) -> None:
        self.entered, self.finish = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.entered.set()
        assert self.finish.wait(30), "the test never finished the copy"


def test_a_copy_stays_pending_until_the_waiting_thread_saw_it_done() -> None:
    """The writer waits while the loop steps: the loop's hook must still see the copy."""
    copier = SideStreamCopy()
    event = _SlowEvent()
    copier._done = event  # as start() leaves it on a GPU
    writer = threading.Thread(target=copier.wait)
    writer.start()
    try:
        assert event.entered.wait(30)
        assert copier.pending  # a step now would still be ordered after the copy
    finally:
        event.finish.set()
        writer.join(30)
    assert not copier.pending


# ------------------------------------------------------------------ the snapshot's side-stream path


def _count_orders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the optimizer steps the guard orders after a copy."""
    orders: list[int] = []
    monkeypatch.setattr(SideStreamCopy, "order_step", lambda self: orders.append(1))
    return orders


def _side_stream_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the side-stream path with CPU tensors: its plumbing without a GPU."""
    real: Callable[..., CopyPath] = copy_path

    def decide(devices: Any, *, guarded: bool, cuda_available: bool) -> CopyPath:
        real(devices, guarded=guarded, cuda_available=cuda_available)
        return CopyPath.SIDE_STREAM if guarded else CopyPath.WAIT

    monkeypatch.setattr(async_save, "copy_path", decide)


def test_the_side_stream_path_guards_the_optimizer_once_and_reuses_its_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _side_stream_everywhere(monkeypatch)
    orders = _count_orders(monkeypatch)
    model, optimizer = model_and_optimizer("cpu")
    snapshot = StateSnapshot(model=model, optimizer=optimizer)
    pointers = []
    for _ in range(3):
        taken = snapshot.take({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        assert snapshot.path is CopyPath.SIDE_STREAM
        snapshot.wait()
        torch.testing.assert_close(taken["model"], model.state_dict(), rtol=0, atol=0)
        pointers.append(taken["model"]["0.weight"].data_ptr())
        snapshot.release()
        optimizer.step()
    assert len(set(pointers)) == 1  # the same host buffers, save after save
    assert len(orders) == 3  # one hook, however many saves
    snapshot.close()
    optimizer.step()
    assert len(orders) == 3  # the hook is gone


def test_without_an_optimizer_a_snapshot_never_takes_the_side_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _side_stream_everywhere(monkeypatch)
    snapshot = StateSnapshot(model=torch.nn.Linear(2, 2))
    snapshot.take({"w": torch.ones(2)})
    assert snapshot.path is CopyPath.WAIT


def test_the_checkpointer_writes_only_once_the_copy_is_done_and_unhooks_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _side_stream_everywhere(monkeypatch)
    orders = _count_orders(monkeypatch)
    events: list[str] = []
    real_write = saving_module.write_replicated

    def write(store: Any, tree: Any, **kwargs: Any) -> Any:
        events.append("write")
        return real_write(store, tree, **kwargs)

    monkeypatch.setattr(saving_module, "write_replicated", write)
    real_wait = StateSnapshot.wait

    def wait(self: StateSnapshot) -> None:
        events.append("wait")
        real_wait(self)

    monkeypatch.setattr(StateSnapshot, "wait", wait)
    model, optimizer = model_and_optimizer("cpu")
    ckpt = ck.Checkpointer(tmp_path, model=model, optimizer=optimizer, handle_sigterm=False)
    ckpt.save(1)
    optimizer.step()
    ckpt.close()
    assert events[:2] == ["wait", "write"]
    assert len(orders) == 1
    optimizer.step()
    assert len(orders) == 1  # closed: no hook left on the user's optimizer


# ------------------------------------------------------------------ on a GPU


Job = tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]


def cuda_job(width: int = 4096) -> Job:
    """Two 4096-wide layers and a batch norm (33.6M parameters, 400 MB with AdamW's state):
    the device-to-host copy takes several times as long as a step's kernels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, width)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, width, device="cuda")).pow(2).mean().backward()
        optimizer.step()

    return model, optimizer, step


def on_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(on_cpu(v) for v in tree)
    return tree


def hold_the_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The writer reads the snapshot only once the returned event is set."""
    go = threading.Event()
    real_write = saving_module.write_replicated

    def held(store: Any, tree: Any, **kwargs: Any) -> Any:
        assert go.wait(60), "the test never let the writer go"
        return real_write(store, tree, **kwargs)

    monkeypatch.setattr(saving_module, "write_replicated", held)
    return go


def saved(root: Path, step: int) -> dict[str, Any]:
    _, state = read_replicated(CheckpointStore(root), root / f"step-{step:010d}", mmap=False)
    return state


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("stage_on_device", [False, True])
def test_a_checkpoint_holds_its_steps_state_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage_on_device: bool
) -> None:
    go = hold_the_writer(monkeypatch)
    model, optimizer, step = cuda_job()
    ckpt = ck.Checkpointer(tmp_path, model=model, optimizer=optimizer, handle_sigterm=False)
    ckpt._saver.snapshot = StateSnapshot(
        model=model, optimizer=optimizer, stage_on_device=stage_on_device
    )
    step()
    expected = on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    ckpt.save(1)
    assert ckpt._saver.snapshot.path is CopyPath.SIDE_STREAM
    for _ in range(5):
        step()  # parameters, moments and running statistics move on (the forward, the step)
    now = on_cpu(model.state_dict())
    for name in ("0.weight", "1.running_mean"):
        assert not torch.equal(now[name], expected["model"][name]), name
    go.set()
    ckpt.close()
    state = saved(tmp_path, 1)
    torch.testing.assert_close(state["model"], expected["model"], rtol=0, atol=0)
    torch.testing.assert_close(
        state["optimizer"]["state"], expected["optimizer"]["state"], rtol=0, atol=0
    )


@needs_cuda
@pytest.mark.cuda
def test_a_save_returns_before_its_copy_is_done_and_reuses_pinned_buffers(
    tmp_path: Path,
) -> None:
    model, optimizer, step = cuda_job()
    ckpt = ck.Checkpointer(tmp_path, model=model, optimizer=optimizer, handle_sigterm=False)
    step()
    ckpt.save(1)  # the first save pins its buffers
    buffers = [b.data_ptr() for b in ckpt._saver.snapshot._buffers]
    assert all(b.is_pinned() for b in ckpt._saver.snapshot._buffers)
    ckpt._saver.writer.wait()
    step()
    expected = on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    torch.cuda._sleep(2_000_000_000)  # the training stream is busy for about a second
    ckpt.save(2)  # the copy waits behind that on its side stream; the save does not
    copy = ckpt._saver.snapshot._copier._done
    assert copy is not None and not copy.query()
    step()  # the next forward, backward and step are queued, not waited for either
    assert not torch.cuda.current_stream().query()
    ckpt.close()
    assert [b.data_ptr() for b in ckpt._saver.snapshot._buffers] == buffers
    state = saved(tmp_path, 2)
    torch.testing.assert_close(state["model"], expected["model"], rtol=0, atol=0)
    torch.testing.assert_close(
        state["optimizer"]["state"], expected["optimizer"]["state"], rtol=0, atol=0
    )


@needs_cuda
@pytest.mark.cuda
def test_pinned_buffers_are_prepared_ahead_of_the_first_take() -> None:
    model, optimizer, step = cuda_job(width=256)
    step()
    snapshot = StateSnapshot(model=model, optimizer=optimizer)
    tree = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    job = snapshot.prepare(tree)
    assert job is not None
    job()
    prepared = [b.data_ptr() for b in snapshot._buffers]
    assert prepared and all(b.is_pinned() for b in snapshot._buffers)
    assert snapshot.prepare(tree) is None  # nothing left to prepare
    snapshot.take(tree)
    snapshot.wait()
    assert [b.data_ptr() for b in snapshot._buffers] == prepared
    snapshot.release()
    snapshot.close()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("stage", [False, True])
def test_a_device_copy_overlaps_and_is_exact_after_wait(stage: bool) -> None:
    model, optimizer = model_and_optimizer("cuda")
    state = [*model.state_dict().values()]
    tensors = [t for t in state if t.is_floating_point()]
    expected = [t.detach().cpu().clone() for t in tensors]
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    copier = SideStreamCopy(stage_on_device=stage)
    handle = copier.guard(optimizer)
    copier.start(tensors, targets, stable=stable_tensors(model, optimizer))
    assert copier.pending
    model(torch.randn(8, 64, device="cuda")).sum().backward()  # the next step's work
    optimizer.step()  # ordered after the copy (unstaged) on the training stream
    copier.wait()
    handle.remove()
    for got, want in zip(targets, expected, strict=True):
        torch.testing.assert_close(got, want)
