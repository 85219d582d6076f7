"""Just-in-time saves: the step boundary, candidates, the fence, the runner's wait (one process)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import checkpoints as ck
from checkpoints.jit import (
    JustInTimeSaver,
    SavingReport,
    clear_reports,
    is_collective_failure,
    keep_waiting,
    read_reports,
    write_notice,
)
from checkpoints.storage import Candidate, CheckpointStore, Fence, jit_name, order_candidates
from tests.support.wait import wait_for

GLOO_ERROR = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:34188. This is typically caused by a remote worker crashing."
)


class Job:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model(torch.randn(3, 4)).pow(2).mean().backward()
        self.optimizer.step()

    def saver(self, root: Path, *, epoch: int = 0, rank: int = 1,
              progress_dir: Path | None = None) -> JustInTimeSaver:
        return JustInTimeSaver(
            CheckpointStore(root),
            rank=rank,
            world_size=2,
            optimizer=self.optimizer,
            small_state=lambda step: {"step": step, "world_size": 2, "scheduler": None,
                                      "scaler": None, "rng": None, "extra": {"at": step}},
            large_state=lambda: {"model": self.model.state_dict(),
                                 "optimizer": self.optimizer.state_dict()},
            epoch=lambda: epoch,
            progress_dir=progress_dir,
        )

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def restore(root: Path) -> tuple[ck.Resume, Job]:
    job = Job()
    with ck.Checkpointer(root, model=job.model, optimizer=job.optimizer,
                         handle_sigterm=False) as ckpt:
        return ckpt.restore(), job


def test_the_last_completed_step_is_saved_as_a_candidate_and_restored(tmp_path: Path) -> None:
    job = Job()
    saver = job.saver(tmp_path, progress_dir=tmp_path)
    for step in range(1, 4):
        job.step()
        saver.boundary(step)
    expected = job.params()
    path = saver.save("test")
    assert path is not None and path.name == jit_name(3, epoch=0, rank=1)
    assert read_reports(tmp_path)[1].state == "done"
    resume, restored = restore(tmp_path)
    assert (resume.step, resume.extra) == (3, {"at": 3})
    for name, value in expected.items():
        torch.testing.assert_close(restored.params()[name], value, rtol=0, atol=0)
    # Promoted to the step's final name; the fence records the restore.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("saving")) == [
        ".fence.json", "step-0000000003"]
    assert CheckpointStore(tmp_path).read_fence() == Fence(epoch=1, step=3)


def test_state_an_optimizer_step_began_to_change_is_never_saved(tmp_path: Path) -> None:
    job = Job()
    saver = job.saver(tmp_path, progress_dir=tmp_path)
    job.step()
    saver.boundary(1)
    job.step()  # the failure comes after the optimizer step, before maybe_save
    assert saver.save("test") is None
    report = read_reports(tmp_path)[1]
    assert report.state == "skipped" and "optimizer step had begun" in report.detail
    assert CheckpointStore(tmp_path).candidates() == []


def test_nothing_is_saved_before_the_first_completed_step(tmp_path: Path) -> None:
    assert Job().saver(tmp_path).save("test") is None


def test_the_save_happens_once_whoever_asks(tmp_path: Path) -> None:
    job = Job()
    saver = job.saver(tmp_path)
    job.step()
    saver.boundary(1)
    first = saver.save("the notice")
    assert first is not None and saver.save("the excepthook") == first
    assert len(CheckpointStore(tmp_path).candidates()) == 1


def test_a_notice_from_the_runner_makes_the_watcher_save(tmp_path: Path) -> None:
    job = Job()
    saver = job.saver(tmp_path, progress_dir=tmp_path)
    saver.arm()
    try:
        job.step()
        saver.boundary(1)
        assert read_reports(tmp_path)[1].state == "armed"
        write_notice(tmp_path, "peer b lost")
        wait_for(lambda: read_reports(tmp_path)[1].state == "done", timeout=10,
                 what="the watcher's save")
    finally:
        saver.disarm()
    assert [c.step for c in CheckpointStore(tmp_path).candidates()] == [1]
    clear_reports(tmp_path)
    assert read_reports(tmp_path) == {} and not (tmp_path / "peer-lost").exists()


def test_a_fenced_out_process_cannot_commit_a_newer_step(tmp_path: Path) -> None:
    """A hung node of epoch 1 wakes after the survivors restored step 5 in epoch 2."""
    survivors = Job()
    with ck.Checkpointer(tmp_path, model=survivors.model, optimizer=survivors.optimizer,
                         handle_sigterm=False) as ckpt:
        ckpt.restore()  # epoch 1
        for _ in range(5):
            survivors.step()
        ckpt.save(5)
    assert restore(tmp_path)[0].step == 5  # epoch 2: the fence is (2, 5)
    hung = Job()
    saver = hung.saver(tmp_path, epoch=1, progress_dir=tmp_path)
    for step in range(1, 8):
        hung.step()
        saver.boundary(step)
    assert saver.save("it woke up") is None
    report = read_reports(tmp_path)[1]
    assert report.state == "failed" and "fenced out" in report.detail
    assert [c.step for c in CheckpointStore(tmp_path).candidates()] == [5]


def test_a_stale_save_that_slipped_past_the_commit_check_is_ignored_at_restore(
    tmp_path: Path,
) -> None:
    job = Job()
    saver = job.saver(tmp_path, epoch=1)
    for step in range(1, 4):
        job.step()
        saver.boundary(step)
        if step == 2:
            assert saver.save("survivor") is not None  # step 2, epoch 1
    late = job.saver(tmp_path, epoch=1, rank=3)
    late.boundary(3)
    assert late.save("late") is not None  # committed just before the fence moved
    store = CheckpointStore(tmp_path)
    store.write_fence(Fence(epoch=2, step=2))  # the survivors' restore chose step 2
    resume, _ = restore(tmp_path)
    assert resume.step == 2
    moved = [p.name for p in tmp_path.iterdir() if p.name.startswith(".invalid-")]
    assert len(moved) == 1 and jit_name(3, epoch=1, rank=3) in moved[0]
    assert store.read_fence() == Fence(epoch=3, step=2)


def test_periodic_saves_carry_the_epoch_and_restores_count_up(tmp_path: Path) -> None:
    job = Job()
    for expected_epoch in (1, 2):
        with ck.Checkpointer(tmp_path, model=job.model, optimizer=job.optimizer,
                             handle_sigterm=False) as ckpt:
            resume = ckpt.restore()
            job.step()
            ckpt.save(resume.step + 1)
        store = CheckpointStore(tmp_path)
        assert store.read_manifest(store.path_of(resume.step + 1)).epoch == expected_epoch


# Pure parts ------------------------------------------------------------------


@given(st.integers(0, 5), st.integers(-1, 50), st.integers(0, 5), st.integers(0, 60))
def test_the_fence_refuses_exactly_older_epochs_newer_steps(
    fence_epoch: int, fence_step: int, epoch: int, step: int
) -> None:
    fenced = Fence(epoch=fence_epoch, step=fence_step).fences_out(step=step, epoch=epoch)
    assert fenced == (epoch < fence_epoch and step > fence_step)
    assert not Fence().fences_out(step=step, epoch=epoch)  # no restore yet: nothing fenced


@given(st.lists(st.tuples(st.integers(0, 9), st.booleans(), st.integers(0, 3),
                          st.integers(0, 3)), max_size=12))
def test_candidates_go_newest_step_first_periodic_before_jit(
    raw: list[tuple[int, bool, int, int]],
) -> None:
    candidates = [Candidate(step=s, path=Path(f"/{i}"), jit=j, epoch=e, rank=r)
                  for i, (s, j, e, r) in enumerate(raw)]
    ordered = order_candidates(candidates)
    assert sorted(ordered, key=id) == sorted(candidates, key=id)
    for a, b in itertools.pairwise(ordered):
        assert a.step >= b.step
        if a.step == b.step:
            assert (a.jit, -a.epoch, a.rank) <= (b.jit, -b.epoch, b.rank)


def test_collective_failures_are_told_from_other_errors() -> None:
    assert is_collective_failure(RuntimeError(GLOO_ERROR))
    assert is_collective_failure(torch.distributed.DistBackendError("NCCL communicator aborted"))
    try:
        try:
            raise RuntimeError(GLOO_ERROR)
        except RuntimeError as exc:
            raise ValueError("while logging the loss") from exc
    except ValueError as chained:
        assert is_collective_failure(chained)
    assert not is_collective_failure(ValueError("bad batch shape"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _report(state: str, pid: int = 10) -> SavingReport:
    return SavingReport(rank=0, pid=pid, state=state)


@pytest.mark.parametrize(
    ("state", "now", "progress_at", "alive", "expected"),
    [
        ("armed", 0.3, 0.0, True, True),  # within the ack window
        ("armed", 0.6, 0.0, True, False),  # never started: hung in C code
        ("saving", 5.0, 4.5, True, True),  # progressing
        ("saving", 5.0, 2.0, True, False),  # stalled
        ("saving", 5.0, 4.9, False, False),  # died
        ("saving", 31.0, 30.9, True, False),  # past the bound
        ("done", 0.1, 0.0, True, False),
        ("skipped", 0.1, 0.0, True, False),
    ],
)
def test_the_runner_waits_only_for_live_progressing_saves(
    state: str, now: float, progress_at: float, alive: bool, expected: bool
) -> None:
    waiting = keep_waiting(
        {0: _report(state)}, now=now, noticed_at=0.0, progress_at={0: progress_at},
        alive=lambda pid: alive, ack_s=0.5, stall_s=2.0, max_s=30.0,
    )
    assert waiting is expected


def test_no_report_means_no_wait() -> None:
    assert not keep_waiting({}, now=0.0, noticed_at=0.0, progress_at={}, alive=lambda pid: True,
                            ack_s=0.5, stall_s=2.0, max_s=30.0)


def test_reports_round_trip_and_junk_is_skipped(tmp_path: Path) -> None:
    from checkpoints.jit import write_report

    write_report(tmp_path, SavingReport(rank=3, pid=os.getpid(), state="saving", step=7, bytes=9))
    (tmp_path / "saving-rank-4.json").write_text("{not json")
    reports: dict[int, Any] = read_reports(tmp_path)
    assert list(reports) == [3] and reports[3].bytes == 9


def test_a_notice_during_an_optimizer_step_saves_that_step_at_its_boundary(
    tmp_path: Path,
) -> None:
    """The runner's notice can land between an optimizer step and its boundary (a
    framework's callbacks run there): the watcher waits for the boundary, bounded."""
    job = Job()
    saver = job.saver(tmp_path, progress_dir=tmp_path)
    saver.arm()
    try:
        job.step()
        saver.boundary(1)
        job.step()  # step 2's optimizer step ran; its boundary has not come yet
        write_notice(tmp_path, "peer b lost")
        wait_for(lambda: saver._boundary._waiters, timeout=10,  # type: ignore[attr-defined]
                 what="the watcher waiting for the boundary")
        expected = job.params()
        saver.boundary(2)
        wait_for(lambda: read_reports(tmp_path)[1].state == "done", timeout=10,
                 what="the watcher's save")
    finally:
        saver.disarm()
    assert [c.step for c in CheckpointStore(tmp_path).candidates()] == [2]
    _, restored = restore(tmp_path)
    for name, value in expected.items():
        torch.testing.assert_close(restored.params()[name], value, rtol=0, atol=0)


def test_a_boundary_that_never_comes_leaves_the_notice_unsaved(tmp_path: Path) -> None:
    job = Job()
    saver = job.saver(tmp_path, progress_dir=tmp_path)
    job.step()
    saver.boundary(1)
    job.step()  # and the main thread never reaches the boundary
    assert saver.save("the notice", boundary_wait_s=0.2) is None
    report = read_reports(tmp_path)[1]
    assert report.state == "skipped" and "optimizer step had begun" in report.detail
