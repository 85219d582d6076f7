"""Lightning with checkpoints.frameworks.lightning's plugin and callback, in real processes.

Two ranks (gloo on CPU), one per node, torchrun-style environment:
``Trainer(strategy="ddp")`` without ``num_nodes`` sees a world of 2 and splits
the data in 2; SIGTERM to one rank stops both at the same step (no hang in
Lightning's handler) with ``last.ckpt``, and ``fit(ckpt_path="last")`` goes on
from that step to the end; a rank killed mid-step leaves the survivor's
just-in-time ``last.ckpt`` of the last completed step, which ``fit`` resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import checkpoints as ck
from tests.integration.checkpoints.frameworks.ranks import run_ranks
from tests.support.processes import ProcessGroupRegistry

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).with_name("lightning_worker.py")
STEPS = 8


def seen(out: Path, rank: int) -> dict[str, object]:
    return dict(json.loads((out / f"rank-{rank}.json").read_text()))


def test_a_ddp_trainer_without_num_nodes_gets_the_jobs_world_size(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    out = tmp_path / "out"
    ranks = run_ranks(procs, WORKER, ["--out", str(out), "--max-steps", "2"], world_size=2,
                      logs=tmp_path, name="world")
    assert [code for code, _ in ranks] == [0, 0], ranks[0][1][-3000:] + ranks[1][1][-3000:]
    for rank in (0, 1):
        assert seen(out, rank) | {"end_step": 2} == {
            "start_step": 0, "world_size": 2, "num_nodes": 2, "global_rank": rank,
            "replicas": 2, "stop_step": None, "end_step": 2,
        }


@pytest.mark.slow  # two 2-rank runs, each importing lightning (about 35 s here)
def test_sigterm_to_one_rank_stops_both_at_one_step_and_fit_last_resumes_it(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    out = tmp_path / "out"
    stopped = run_ranks(procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS),
                                        "--sigterm-at", "2", "--sigterm-rank", "1"],
                        world_size=2, logs=tmp_path, name="stopped",
                        extra_env={ck.PROGRESS_DIR_ENV: str(tmp_path / "progress")})
    assert [code for code, _ in stopped] == [ck.EXIT_PREEMPTED] * 2, (
        stopped[0][1][-3000:] + stopped[1][1][-3000:])
    assert {seen(out, r)["stop_step"] for r in (0, 1)} == {3}  # agreed one step late
    assert (out / "ckpt" / "last.ckpt").exists()
    for rank in (0, 1):
        report = json.loads((tmp_path / "progress" / f"rank-{rank}.json").read_text())
        assert report["step"] == 3 and report["stop_requested"] is True
        assert report["total_steps"] == STEPS and isinstance(report["loss"], float)
        assert [s for s, _ in report["paces"]] == [1, 2, 3]

    resumed = run_ranks(procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS),
                                        "--result", str(tmp_path / "resumed.pt")],
                        world_size=2, logs=tmp_path, name="resumed")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert seen(out, 0)["start_step"] == 3 and seen(out, 0)["end_step"] == STEPS
    # Not compared with an uninterrupted run: from a checkpoint in mid-epoch, Lightning
    # replays that epoch's batches from its start with a plain DataLoader (tried with
    # torchdata's StatefulDataLoader too: it did not resume under ddp here).


KILL_AT = 3  # the last step rank 1 completes: it SIGKILLs itself as step 4 begins


@pytest.mark.slow  # two 2-rank runs, each importing lightning (about 35 s here)
def test_a_rank_killed_mid_step_leaves_the_last_completed_step_as_last_ckpt_and_fit_resumes_it(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    """Rank 1 dies in step 4; the survivor fails in its gradient all-reduce and writes
    ``last.ckpt`` of step 3 (no collective), holding exactly its parameters after step 3;
    ``fit(ckpt_path="last")`` starts from step 3: the step in flight is all that is redone."""
    out, progress = tmp_path / "out", tmp_path / "progress"
    killed = run_ranks(
        procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS), "--kill-at", str(KILL_AT),
                        "--kill-rank", "1", "--snapshot", str(tmp_path / "step.pt")],
        world_size=2, logs=tmp_path, name="killed",
        extra_env={ck.PROGRESS_DIR_ENV: str(progress)},
    )
    codes = [code for code, _ in killed]
    assert codes == [1, -9], (codes, killed[0][1][-3000:])
    assert f"just-in-time save of step {KILL_AT}" in killed[0][1]
    last = out / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == KILL_AT
    torch.testing.assert_close(checkpoint["state_dict"], torch.load(tmp_path / "step.pt"))
    report = json.loads((progress / "saving-rank-0.json").read_text())
    assert report["state"] == "done" and report["step"] == KILL_AT

    resumed = run_ranks(procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS)],
                        world_size=2, logs=tmp_path, name="resumed")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert seen(out, 0)["start_step"] == KILL_AT and seen(out, 0)["end_step"] == STEPS
