"""The GPU check's dry run (``make gpu-check DRY_RUN=1``) on this CPU machine, so it cannot rot.

A GPU is lent only now and then, for minutes; the check must then run first
time. Here the same script runs with ``--dry-run``: every part must end ok or
skipped (never failed), what needs CUDA must be skipped saying so, the CPU
stand-ins must say what they are, and the JSON and the markdown must hold
every part. Every process the run started is gone afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.gpu.procs import MARKER, marked_processes

REPO = Path(__file__).resolve().parents[2]
PARTS = [1, 2, 3, 4, 5, 6, 7]
CUDA_ONLY = {  # a check that exists only on a GPU, as the dry run must name it
    3: "charlm 200m step time on the GPU",
    4: "steps lost per save, 200m model + AdamW on the GPU",
    5: "the restart path on the GPU",
    6: "NCCL process group (1 rank)",
    7: "a lost node on the GPU, in place and restarted",
}
STAND_IN = {  # what each CPU stand-in's check name must say
    3: "dry run stand-in", 4: "on the CPU", 5: "dry run stand-in", 6: "dry run stand-in",
    7: "in-place: node SIGKILLed",
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_check_runs_dry_skipping_cuda_and_saying_so(tmp_path: Path) -> None:
    out, run_id = tmp_path / "out", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env[MARKER] = run_id  # every process of the run carries it: swept up below
    log = tmp_path / "check.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.check", "--dry-run", "--out", str(out),
             "--work", str(tmp_path / "work"), "--total-s", "840", "--budget-scale", "3"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        code = proc.wait(timeout=870)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = marked_processes(run_id)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
    output = log.read_text(errors="replace")[-6000:]
    assert not left, f"the check left processes behind: {left}\n{output}"
    report = json.loads((out / "gpu-check.json").read_text())
    markdown = (out / "gpu-check.md").read_text()
    assert code == 0, output

    assert report["format"] == "tidal-gpu-check" and report["dry_run"] is True
    assert report["install"]["outcome"] == "skipped" and "dry run" in report["install"]["reason"]
    parts = {p["number"]: p for p in report["parts"]}
    assert sorted(parts) == PARTS
    for number, part in parts.items():
        assert part["outcome"] in ("ok", "skipped"), (number, part["reason"])
        checks = {c["name"]: c for c in part["checks"]}
        for check in part["checks"]:
            assert check["outcome"] != "failed", (number, check)
            if check["outcome"] == "skipped":
                assert check["detail"], f"part {number}: {check['name']} skipped without a why"
        if number in CUDA_ONLY:
            assert checks[CUDA_ONLY[number]]["detail"] == "dry run: no CUDA on this machine"
        if number in STAND_IN:
            ran = [c["name"] for c in part["checks"] if STAND_IN[number] in c["name"]]
            assert ran and all(checks[n]["outcome"] == "ok" for n in ran), (number, checks)
        assert f"| {number}. {part['title']} | {part['outcome']} |" in markdown
    # Part 1 collected the cuda tests and skipped each for want of CUDA.
    assert parts[1]["figures"]["skipped"] >= 1 and parts[1]["figures"]["passed"] == 0
    # Part 2 went through the whole GPU path of tidal up with an index for a GPU.
    assert {c["name"]: c["outcome"] for c in parts[2]["checks"]} == {
        "tidal up": "ok",
        "inventory (dry run: --gpus-per-agent 1, indices without NVML)": "ok",
        "a GPU job placed and isolated (CUDA_VISIBLE_DEVICES)": "ok",
        "a second job wanting the GPU waits": "ok",
        "it starts once the GPU is free": "ok",
        "GPU metrics scraped from the agent's /metrics": "ok",
        "GPU readings (utilization, memory, power, temperature)": "skipped",
    }
    restart = next(c for c in parts[5]["checks"] if c["name"].startswith("worker killed"))
    assert {"detect_and_spawn_s", "state_load_s", "first_step_s", "total_s"} <= set(
        restart["figures"])
    # Part 7 recovered a SIGKILLed node in place, with its breakdown.
    in_place = next(c for c in parts[7]["checks"] if c["name"].startswith("in-place"))
    assert in_place["figures"]["kills"] == 1 and "re-form_s" in in_place["figures"]
