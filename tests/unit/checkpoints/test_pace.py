"""A rank's own pace (checkpoints.pace): forward start to last gradient, per step."""

from __future__ import annotations

import torch

from checkpoints.pace import KEEP_STEPS, PaceMeter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Slow(torch.nn.Module):
    """A model whose forward and backward advance a fake clock."""

    def __init__(self, clock: Clock, forward_s: float) -> None:
        super().__init__()
        self.clock, self.forward_s = clock, forward_s
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.forward_s
        return self.layer(x)


def test_the_pace_runs_from_the_first_forward_to_the_last_gradient() -> None:
    clock = Clock()
    model = Slow(clock, forward_s=0.5)
    meter = PaceMeter(model, clock=clock)
    clock.now = 10.0
    model(torch.ones(2, 4)).sum().backward()  # forward starts at 10.0, grads at 10.5
    clock.now = 12.0  # waiting for the others, then the optimizer: not counted
    assert meter.boundary(1) == 0.5
    assert meter.recent() == [(1, 0.5)]


def test_gradient_accumulation_counts_every_micro_batch() -> None:
    clock = Clock()
    model = Slow(clock, forward_s=0.25)
    meter = PaceMeter(model, clock=clock)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
    assert meter.boundary(7) == 0.75


def test_a_step_without_forward_or_backward_has_no_pace_and_a_discarded_one_is_forgotten() -> None:
    clock = Clock()
    model = Slow(clock, forward_s=1.0)
    meter = PaceMeter(model, clock=clock)
    assert meter.boundary(1) is None
    model(torch.ones(2, 4))  # forward only: the step failed before its backward
    meter.discard()
    model(torch.ones(2, 4)).sum().backward()
    assert meter.boundary(2) == 1.0
    assert meter.recent() == [(2, 1.0)]


def test_only_the_last_steps_are_kept_and_close_removes_the_hooks() -> None:
    clock = Clock()
    model = Slow(clock, forward_s=0.1)
    meter = PaceMeter(model, clock=clock)
    for step in range(KEEP_STEPS + 5):
        model(torch.ones(1, 4)).sum().backward()
        meter.boundary(step)
    assert [s for s, _ in meter.recent()] == list(range(5, KEEP_STEPS + 5))
    meter.close()
    model(torch.ones(1, 4)).sum().backward()
    assert meter.boundary(999) is None



def test_the_progress_file_carries_the_recent_paces(tmp_path) -> None:
    import json

    from checkpoints.progress import FileProgressReporter
    from checkpoints.protocol.progress import ProgressReport

    clock = Clock()
    model = Slow(clock, forward_s=0.5)
    meter = PaceMeter(model, clock=clock)
    reporter = FileProgressReporter(tmp_path, rank=0, world_size=1)
    reporter.set_pace_source(meter.recent)
    for step in (1, 2):
        model(torch.ones(1, 4)).sum().backward()
        meter.boundary(step)
        reporter.record(step=step)
    reporter.flush()
    report = ProgressReport.from_json(json.loads(reporter.path.read_text()))
    assert report is not None and report.paces == ((1, 0.5), (2, 0.5))
