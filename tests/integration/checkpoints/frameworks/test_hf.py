"""The Hugging Face Trainer with checkpoints.frameworks.hf.TidalCallback, in real processes.

Two ranks (gloo on CPU) train a tiny GPT-2 built from a config. SIGTERM to one
rank stops both at the same step with the Trainer's own checkpoint and exit
code 75; ``train(resume_from_checkpoint=...)`` from it ends with the same
parameters as an uninterrupted run. Progress and paces reach the progress
directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import checkpoints as ck
from tests.integration.checkpoints.frameworks.ranks import run_ranks
from tests.support.processes import ProcessGroupRegistry

pytest.importorskip("transformers")
# Slow: three runs of 2 or 3 ranks per test, each importing transformers (70 s a test here).
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

WORKER = Path(__file__).with_name("hf_worker.py")
STEPS = 12


def test_sigterm_to_one_rank_stops_both_at_one_step_and_the_resume_matches_an_uninterrupted_run(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    straight = run_ranks(procs, WORKER, ["--out", str(tmp_path / "straight"), "--max-steps",
                                         str(STEPS), "--result", str(tmp_path / "straight.pt")],
                         world_size=2, logs=tmp_path, name="straight")
    assert [code for code, _ in straight] == [0, 0], straight[0][1][-3000:] + straight[1][1][-3000:]

    out, progress = tmp_path / "stopped", tmp_path / "progress"
    stopped = run_ranks(
        procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS), "--sigterm-at", "5",
                        "--sigterm-rank", "1"],
        world_size=2, logs=tmp_path, name="stopped",
        extra_env={ck.PROGRESS_DIR_ENV: str(progress)},
    )
    assert [code for code, _ in stopped] == [ck.EXIT_PREEMPTED] * 2, (
        stopped[0][1][-3000:] + stopped[1][1][-3000:])
    steps = {json.loads((out / f"stopped-rank-{r}.json").read_text())["stop_step"] for r in (0, 1)}
    assert steps == {6}  # the flag raised after step 5 is agreed one step late, on both ranks
    assert (out / "checkpoint-6" / "trainer_state.json").exists()
    assert (out / "checkpoint-6" / "rng_state_1.pth").exists()  # rank 1's part is written too
    for rank in (0, 1):
        report = json.loads((progress / f"rank-{rank}.json").read_text())
        assert report["step"] == 6 and report["stop_requested"] is True
        assert report["total_steps"] == STEPS
        assert report["last_checkpoint_step"] == 6
        assert isinstance(report["loss"], float)
        assert [s for s, _ in report["paces"]] == list(range(1, 7))

    resumed = run_ranks(procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS),
                                        "--result", str(tmp_path / "resumed.pt")],
                        world_size=2, logs=tmp_path, name="resumed")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert "resuming from" in resumed[0][1] and "checkpoint-6" in resumed[0][1]
    torch.testing.assert_close(torch.load(tmp_path / "resumed.pt"),
                               torch.load(tmp_path / "straight.pt"))


KILL_AT = 4  # the last step rank 2 completes: it SIGKILLs itself as step 5 begins


@pytest.mark.timeout(900)  # three 3-rank runs on a shared machine
def test_a_rank_killed_mid_step_leaves_the_last_completed_step_and_the_resume_matches(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    """Three ranks; rank 2 dies in step 5. The two survivors fail in its gradient all-reduce,
    both write ``checkpoint-4`` in the Trainer's layout (no collective), and the documented
    resume redoes no completed step and ends where an uninterrupted run does."""
    straight = run_ranks(procs, WORKER, ["--out", str(tmp_path / "straight"), "--max-steps",
                                         str(STEPS), "--result", str(tmp_path / "straight.pt")],
                         world_size=3, logs=tmp_path, name="straight3", timeout=240)
    assert [code for code, _ in straight] == [0, 0, 0], straight[0][1][-3000:]

    out, progress = tmp_path / "killed", tmp_path / "progress"
    killed = run_ranks(
        procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS), "--kill-at", str(KILL_AT),
                        "--kill-rank", "2"],
        world_size=3, logs=tmp_path, name="killed", timeout=240,
        extra_env={ck.PROGRESS_DIR_ENV: str(progress)},
    )
    codes = [code for code, _ in killed]
    assert codes[2] == -9 and codes[0] == codes[1] == 1, (
        codes, killed[0][1][-3000:] + killed[1][1][-3000:])
    for _, text in killed[:2]:
        assert f"just-in-time save of step {KILL_AT}" in text
    checkpoint = out / f"checkpoint-{KILL_AT}"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt",
            "trainer_state.json", "training_args.bin", "rng_state_0.pth",
            "rng_state_1.pth"} <= names, names  # each survivor's random state
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == [checkpoint.name]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == KILL_AT
    for rank in (0, 1):  # what the runner reads while it waits for the saves
        report = json.loads((progress / f"saving-rank-{rank}.json").read_text())
        assert report["state"] == "done" and report["step"] == KILL_AT

    resumed = run_ranks(procs, WORKER, ["--out", str(out), "--max-steps", str(STEPS),
                                        "--result", str(tmp_path / "resumed.pt")],
                        world_size=3, logs=tmp_path, name="resumed3", timeout=240)
    assert [code for code, _ in resumed] == [0, 0, 0], resumed[0][1][-3000:]
    assert f"resuming from {checkpoint}" in resumed[0][1]
    started = json.loads((out / "started-rank-0.json").read_text())["step"]
    # Step KILL_AT + 1 was in flight at the kill: at most it is redone.
    assert KILL_AT + 1 - started <= 1 and started == KILL_AT
    torch.testing.assert_close(torch.load(tmp_path / "resumed.pt"),
                               torch.load(tmp_path / "straight.pt"))
