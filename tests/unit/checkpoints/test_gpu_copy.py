"""checkpoints.gpu_copy: copies into reused host buffers, off the training stream on a GPU."""

from __future__ import annotations

import pytest
import torch

from checkpoints.gpu_copy import SideStreamCopy, stable_tensors

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def model_and_optimizer(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


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


def test_the_guard_waits_before_each_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _, optimizer = model_and_optimizer("cpu")
    copier = SideStreamCopy()
    waits: list[int] = []
    monkeypatch.setattr(copier, "wait", lambda: waits.append(1))
    handle = copier.guard(optimizer)
    optimizer.step()
    optimizer.step()
    handle.remove()
    optimizer.step()
    assert len(waits) == 2


@cuda
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
    optimizer.step()  # the guard waits for the copy (unstaged) before changing parameters
    copier.wait()
    handle.remove()
    for got, want in zip(targets, expected, strict=True):
        torch.testing.assert_close(got, want)
