"""The live resize with real workers: a join and a leave without restarting anyone.

Five processes run examples/mlp.py --live-resize (float64, DDP over gloo) on
three "nodes" (a progress directory each, as a runner gives its workers);
the test plays the runners, writing checkpoints.live's notices exactly as
they do. Nodes a (two workers) and b train at world size 3; c's worker starts
in the next round as its rank 0 (so it hosts the new group's store, and the
state comes from rank 1) and receives the state in ``restore()`` while the
others re-form the group at 4 under new ranks; then b's node leaves
(``live-leave.json``): b exits 77 and a and c go on at 3 to the end. No
process restarts, every step is taken exactly once, and the final parameters
equal those of an uninterrupted single-process run with the same global
batch (10: split 4/3/3 at 3 ranks, 3/3/2/2 at 4, micro-batches of at most 4).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpoints import Checkpointer, Resize
from checkpoints.live import (
    EXIT_LEFT,
    LiveState,
    ResizeNotice,
    WorkerLive,
    read_worker_live,
    write_leave_notice,
    write_resize_notice,
)
from rendezvous.etcd.server import free_port
from tests.integration.checkpoints.test_acid import params_of
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[4]
MLP = REPO / "examples" / "mlp.py"
TOTAL_STEPS = 70  # the join and the leave come within the first ~12: room for a slow test process
ARGS = [
    "--total-steps", str(TOTAL_STEPS), "--global-batch-size", "10", "--max-local-batch", "4",
    "--dataset-size", "64", "--dtype", "float64", "--every-steps", "8", "--seed", "3",
]
# Rounding only: different world sizes group the gradient sums differently.
ATOL = 1e-10
_STEP = re.compile(r"rank (\d+) world_size (\d+) step (\d+) loss")


class Worker:
    """One worker process, local rank ``local_rank`` of its node (the progress directory)."""

    def __init__(self, procs: ProcessGroupRegistry, tmp_path: Path, node: str,
                 local_rank: int = 0) -> None:
        self.name = f"{node}{local_rank}"
        self.dir = tmp_path / node
        self.dir.mkdir(exist_ok=True)
        self.local_rank = local_rank
        self.log = tmp_path / f"{self.name}.log"
        self._procs, self._tmp = procs, tmp_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, rank: int, world_size: int, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "TORCHELASTIC"))}
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TIDAL_PROGRESS_DIR=str(self.dir),
            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )
        argv = [
            sys.executable, str(MLP), "--checkpoint-dir", str(self._tmp / "ckpt"),
            "--record", str(self._tmp / "live.json"), "--live-resize", "--step-seconds", "0.1",
            *ARGS,
        ]
        self.proc = self._procs.spawn(argv, log_path=self.log, env=env, cwd=REPO)

    def steps(self) -> list[tuple[int, int, int]]:
        """(rank, world size, step) of every step this worker logged, in order."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [(int(r), int(w), int(s)) for r, w, s in _STEP.findall(text)]

    def resized_to(self, round_: int) -> bool:
        live = read_worker_live(self.dir, self.local_rank)
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
        return live is not None and live.state is LiveState.RESIZED and live.round == round_

    def exit_code(self, timeout: float) -> int:
        assert self.proc is not None
        proc = self.proc
        wait_for(lambda: proc.poll() is not None, timeout=timeout, what=f"{self.name} to exit")
        return proc.returncode

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def tell(node: Path, round_: int, *, port: int, world_size: int, ranks: dict[int, int]) -> None:
    """What a staying node's runner does once round ``round_`` formed."""
    write_resize_notice(node, ResizeNotice(
        round=round_, master_addr="127.0.0.1", master_port=port, world_size=world_size,
        ranks=ranks, written_at=time.time(),
    ))


def start_reference(procs: ProcessGroupRegistry, tmp_path: Path) -> subprocess.Popen[bytes]:
    """The same training in one uninterrupted process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TIDAL_", "TORCHELASTIC")) and k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ref-ckpt"),
            "--record", str(tmp_path / "reference.json"), *ARGS]
    return procs.spawn(argv, log_path=tmp_path / "reference.log", env=env, cwd=REPO)


def reference(proc: subprocess.Popen[bytes], tmp_path: Path) -> dict[str, Any]:
    wait_for(lambda: proc.poll() is not None, timeout=120, what="the reference run to finish")
    log_text = (tmp_path / "reference.log").read_text(errors="replace")
    assert proc.returncode == 0, log_text[-3000:]
    return dict(json.loads((tmp_path / "reference.json").read_text()))


@pytest.mark.slow  # five processes start torch: 50-60 s on the loaded 2-core machine
def test_a_worker_joins_and_a_node_leaves_live_and_the_job_ends_as_an_uninterrupted_run(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    uninterrupted = start_reference(procs, tmp_path)
    a0, a1, b0, c0 = (Worker(procs, tmp_path, node, lr)
                      for node, lr in (("a", 0), ("a", 1), ("b", 0), ("c", 0)))
    port = free_port()
    for rank, worker in enumerate((a0, a1, b0)):
        worker.start(rank=rank, world_size=3, port=port)
    wait_for(lambda: all(len(w.steps()) >= 3 for w in (a0, a1, b0)), timeout=60,
             what="a and b to train at world size 3")

    # Round 1: c joins as rank 0. Its runner starts its worker in the new round;
    # the others' runners tell theirs.
    port = free_port()
    c0.start(rank=0, world_size=4, port=port)
    tell(a0.dir, 1, port=port, world_size=4, ranks={0: 1, 1: 2})
    tell(b0.dir, 1, port=port, world_size=4, ranks={0: 3})
    wait_for(lambda: all(w.resized_to(1) for w in (a0, a1, b0)) and c0.steps(), timeout=90,
             what="a and b to resize into round 1 and c to train")

    # Round 2: b's node leaves; a and c go on as ranks 0, 1 and 2.
    write_leave_notice(b0.dir)
    port = free_port()
    tell(a0.dir, 2, port=port, world_size=3, ranks={0: 0, 1: 1})
    tell(c0.dir, 2, port=port, world_size=3, ranks={0: 2})
    assert b0.exit_code(60) == EXIT_LEFT, b0.tail()
    left_file = read_worker_live(b0.dir, 0)
    assert left_file is not None and left_file.state is LiveState.LEFT
    for worker in (a0, a1, c0):
        assert worker.exit_code(90) == 0, worker.tail()

    # Every step was taken once by each rank of its world size, in order, by the
    # processes started at the beginning: none was lost, none was done twice.
    ran: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for worker in (a0, a1, b0, c0):
        steps = [step for _, _, step in worker.steps()]
        assert steps == list(range(steps[0], steps[0] + len(steps))), worker.name
        for rank, world_size, step in worker.steps():
            ran[step].append((world_size, rank))
    assert sorted(ran) == list(range(TOTAL_STEPS))
    sizes: list[int] = []
    for step in range(TOTAL_STEPS):
        (world_size, _), *_ = ran[step]
        assert sorted(ran[step]) == [(world_size, r) for r in range(world_size)], (step, ran[step])
        if not sizes or sizes[-1] != world_size:
            sizes.append(world_size)
    assert sizes == [3, 4, 3]
    assert [w.steps()[0][2] for w in (a0, a1, b0)] == [0, 0, 0]
    joined, left = c0.steps()[0][2], b0.steps()[-1][2] + 1
    assert 0 < joined < left < TOTAL_STEPS
    assert [(w.steps()[0][0], w.steps()[-1][0]) for w in (a0, a1, c0)] == [(0, 0), (1, 1), (0, 2)]
    joiner_log = c0.log.read_text()
    assert f"start at step {joined} (fresh=False, saved at world size 3)" in joiner_log
    assert "state received from rank 1" in joiner_log
    assert "restored step" not in joiner_log  # the state came live, not from disk

    # The final parameters are the uninterrupted run's; so are the samples of the
    # steps the final ranks took together (the leaver's shares left with it).
    ref = reference(uninterrupted, tmp_path)
    live = json.loads((tmp_path / "live.json").read_text())
    assert [s["step"] for s in live["steps"]] == list(range(TOTAL_STEPS))
    for got, want in zip(live["steps"], ref["steps"], strict=True):
        if got["step"] >= left:
            assert got["samples"] == want["samples"], got["step"]
        else:
            assert not collections.Counter(got["samples"]) - collections.Counter(want["samples"])
    final, expected = params_of(live), params_of(ref)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=ATOL, rtol=0)


@pytest.fixture
def single_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """This process as rank 0 of 1 (gloo), its progress directory set; the group ends after."""
    progress = tmp_path / "node"
    progress.mkdir()
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port()), TIDAL_PROGRESS_DIR=str(progress)).items():
        monkeypatch.setenv(name, value)
    for name in ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # a resize sets them: put them back after
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        yield progress
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_single_rank_announces_the_live_path_resizes_into_a_new_group_and_withdraws(
    single_rank: Path, tmp_path: Path
) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Resize] = []
    ckpt = Checkpointer(tmp_path / "ckpt", model=model, optimizer=optimizer,
                        handle_sigterm=False, on_resize=seen.append)
    assert read_worker_live(single_rank, 0) == WorkerLive(os.getpid(), 0, None, LiveState.READY)
    assert ckpt.restore().fresh
    ckpt.maybe_save(1)
    assert not seen

    port = free_port()
    write_resize_notice(single_rank, ResizeNotice(
        round=4, master_addr="127.0.0.1", master_port=port, world_size=1, ranks={0: 0},
        written_at=time.time(), group_rank=0, group_world_size=1,
    ))
    ckpt.maybe_save(2)  # a single rank needs no agreement: it acts at once
    assert seen == [Resize(rank=0, world_size=1, previous_world_size=1, step=2, round=4)]
    assert read_worker_live(single_rank, 0) == WorkerLive(os.getpid(), 4, 2, LiveState.RESIZED)
    assert (os.environ["MASTER_PORT"], os.environ["GROUP_WORLD_SIZE"]) == (str(port), "1")
    dist.barrier()  # the new group works
    ckpt.maybe_save(3)  # the same notice again: nothing to do
    assert len(seen) == 1
    ckpt.close()
    assert read_worker_live(single_rank, 0) is None  # closed: it can no longer resize


def test_a_step_discarded_after_a_lost_member_is_taken_again_with_the_same_random_numbers(
    single_rank: Path, tmp_path: Path
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Resize] = []
    ckpt = Checkpointer(tmp_path / "ckpt", model=model, optimizer=optimizer,
                        handle_sigterm=False, on_resize=seen.append)
    assert ckpt.restore().fresh
    torch.manual_seed(7)
    random.seed(7)
    ckpt.maybe_save(1)
    # Step 2 starts: a dropout mask and an augmentation drawn, then its all-reduce fails.
    mask = model(torch.ones(2, 3)).detach()
    jitter = random.random()
    model(torch.ones(2, 3)).sum().backward()
    write_resize_notice(single_rank, ResizeNotice(
        round=2, master_addr="127.0.0.1", master_port=free_port(), world_size=1, ranks={0: 0},
        written_at=time.time(), group_rank=0, group_world_size=1, lost=True,
    ))
    assert ckpt.recover(dist.DistError("gloo: Connection closed by peer")) == 1
    assert seen == [Resize(rank=0, world_size=1, previous_world_size=1, step=1, round=2,
                           lost=True)]
    assert all(p.grad is None for p in model.parameters())  # the partial step is gone
    # Step 2 again, from the generators' states it first started from.
    assert torch.equal(model(torch.ones(2, 3)).detach(), mask)
    assert random.random() == jitter
    ckpt.maybe_save(2)
    ckpt.close()


def test_without_on_resize_or_a_progress_directory_nothing_is_announced(
    single_rank: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(3, 1)
    Checkpointer(tmp_path / "a", model=model, handle_sigterm=False).close()
    monkeypatch.delenv("TIDAL_PROGRESS_DIR")
    Checkpointer(tmp_path / "b", model=model, handle_sigterm=False, on_resize=print).close()
    assert not list(single_rank.glob("live-*"))
