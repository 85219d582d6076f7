"""The chaos soak: random kills and stops while an acid-test job trains, and nothing lost.

A 3-member etcd cluster, two coordinators and three agents run examples/mlp.py
(float64, DDP over gloo, the checkpoints library) as one job of 1..3 nodes.
Meanwhile, one fault at a time, chosen by a seeded random generator (the seed
is printed; ``TIDAL_CHAOS_SEED=N make chaos`` replays the same choices, though
not the same timing), the soak SIGKILLs an agent (its process group, restarted
once its node is declared lost, as an operator's supervisor would), a job
runner, a training worker, one of the two coordinators (restarted), or one etcd
member (restarted on its data directory), or SIGSTOPs an agent's process group,
the leading coordinator or an etcd member for a while and then SIGCONTs it.
After each fault it waits, with a deadline, until the job is back at three
nodes and past the step it was at, then for a few more steps.

At the end: the job SUCCEEDED with the parameters of the same script run
uninterrupted under plain torchrun; each fault that must produce job events
did (tests/chaos/plan.py, ``EVENT_OF``: a killed worker or runner a
``restart_charged`` event naming its node), the others left their trace in the
leadership and declared no node falsely lost; and no
process the test started, or that they started, is left.

``TIDAL_CHAOS_SECONDS`` is how long faults keep coming, once each kind was
injected; the default, 0, is what `make test` runs: each kind of fault once.
`make chaos` runs it longer and prints the counts
(tests/chaos/report.py), saved as JSON to ``TIDAL_CHAOS_REPORT`` if set.
``TIDAL_CHAOS_RUNNER_KILLS=0`` leaves runner kills out of the mix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.cluster import MLP, NODES, ChaosCluster, processes_with_env
from tests.chaos.plan import FaultKind, fault_plan
from tests.chaos.report import Tally, format_counts
from tests.chaos.soak import Soak
from tests.support.acid import (
    assert_same_params,
    max_difference,
    record_params,
    start_reference,
    wait_reference,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
CHAOS_SECONDS = float(os.environ.get("TIDAL_CHAOS_SECONDS", "0"))
RUNNER_KILLS = os.environ.get("TIDAL_CHAOS_RUNNER_KILLS", "1") != "0"
STEP_SECONDS = 0.05
# Enough steps that training outlasts the faults, and not many more: after
# them the job trains out its remaining steps undisturbed. The job keeps
# training at a smaller size while a node is away: a fault and its recovery
# took 30 to 200 steps (2.5 to 4 steps/s over a soak) on the loaded 2-core
# machine, and one of each kind about 500 steps.
TOTAL_STEPS = max(900, int(CHAOS_SECONDS * 4) + 400)
#: Faults stop this many steps before the end, so that each has room to recover.
END_MARGIN_STEPS = 150
ARGS = [
    "--total-steps", str(TOTAL_STEPS), "--global-batch-size", "10", "--dataset-size", "96",
    "--dtype", "float64", "--every-steps", "2", "--seed", "5",
]
MARKER = "TIDAL_CHAOS_RUN"


def _kinds() -> list[FaultKind]:
    return [k for k in FaultKind if RUNNER_KILLS or k != FaultKind.KILL_RUNNER]


def _run_faults(soak: Soak, rng: random.Random) -> None:
    """Inject faults until the time is up (and every kind was hit once) or the job nears its end."""
    kinds = _kinds()
    deadline = time.monotonic() + CHAOS_SECONDS
    for n, kind in enumerate(fault_plan(rng, kinds)):
        step = soak.view()["last_step"] or 0
        if n >= len(kinds) and time.monotonic() >= deadline:
            return
        assert step < TOTAL_STEPS - END_MARGIN_STEPS, (
            f"the job reached step {step} of {TOTAL_STEPS} after {n} faults, before every kind "
            f"({', '.join(k.value for k in kinds)}) was injected once: the soak is too short")
        fault = soak.inject(kind)
        # Spacing: a few more steps at full size before the next fault.
        gap = rng.randint(4, 16)
        soak.wait_progress(max(fault.step, soak.view()["last_step"] or 0) + gap,
                           what=f"{gap} steps after {kind.value}")
        if (soak.view()["last_step"] or 0) >= TOTAL_STEPS - END_MARGIN_STEPS:
            return


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(int(CHAOS_SECONDS * 3) + 480)
def test_random_kills_and_stops_while_training_end_with_the_uninterrupted_parameters(
    tmp_path: Path,
    procs: ProcessGroupRegistry,
    durable_etcd_binary: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="httpx")  # one line per API call otherwise
    seed = int(os.environ.get("TIDAL_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    replay = (f"replay the choices with TIDAL_CHAOS_SEED={seed} "
              f"TIDAL_CHAOS_SECONDS={CHAOS_SECONDS:g}")
    with capsys.disabled():
        print(f"\nchaos soak: seed {seed}; {replay}", flush=True)
    log.info("chaos soak: seed %d, %g s of faults, %d steps", seed, CHAOS_SECONDS, TOTAL_STEPS)
    rng = random.Random(seed)
    # Every process the test starts, and every one they start, inherits this:
    # at the end none may be left.
    marker = f"{MARKER}={uuid.uuid4().hex}"
    monkeypatch.setenv(MARKER, marker.split("=", 1)[1])

    reference, reference_record = start_reference(procs, tmp_path, ARGS)
    tally = Tally(seed=seed, seconds=CHAOS_SECONDS, total_steps=TOTAL_STEPS)
    cluster = ChaosCluster(procs=procs, workdir=tmp_path, etcd_binary=durable_etcd_binary)
    record = tmp_path / "chaos.json"
    soak: Soak | None = None
    try:
        cluster.start()
        job_id = str(cluster.api("POST", "/v1/jobs", json={
            "name": "chaos",
            "command": [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        *ARGS, "--step-seconds", str(STEP_SECONDS), "--record", str(record)],
            "min_nodes": 1, "max_nodes": len(NODES), "max_restarts": 1000,
            "grace_period_s": 10,
        })["job_id"])
        soak = Soak(cluster, job_id, rng, tally)
        soak.wait_progress(5, what="the first steps")
        _check_marked(cluster, marker)
        _run_faults(soak, rng)

        def ended() -> dict[str, Any] | None:
            view = soak.view() if soak is not None else {}
            return view if view.get("phase") in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        view = wait_for(ended, timeout=TOTAL_STEPS * STEP_SECONDS * 3 + 120, interval=0.5,
                        what="the job's end")
        tally.succeeded = view["phase"] == "SUCCEEDED"
        tally.restarts = dict(view["restarts"])
        assert tally.succeeded, f"the job ended {view['phase']}: {view.get('error')}"
        wait_reference(reference, tmp_path)
    except BaseException as exc:
        log.error("chaos soak failed; %s\n%s", replay, cluster.log_tails())
        cluster.close()
        _finish(tally, procs, marker, tmp_path)
        raise AssertionError(f"chaos seed {seed}: {exc} ({replay})") from exc

    want = record_params(reference_record)
    elastic = json.loads(record.read_text())
    got = record_params(elastic)
    # The last run's first step (its checkpoint) plus the steps it trained: all of them.
    tally.final_step = int(elastic["first_step"]) + len(elastic["steps"])
    tally.max_abs_diff = max_difference(got, want)
    cluster.close()
    leftovers = _finish(tally, procs, marker, tmp_path)
    with capsys.disabled():
        print(format_counts(tally.counts()), flush=True)
    assert tally.final_step == TOTAL_STEPS, (
        f"the job ended after step {tally.final_step} of {TOTAL_STEPS} (seed {seed})")
    assert not leftovers, f"processes of the soak left after its end: {leftovers} (seed {seed})"
    assert soak is not None and not soak.problems, (
        f"faults that left no trace (seed {seed}):\n" + "\n".join(soak.problems))
    try:
        assert_same_params(got, want)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (chaos seed {seed})") from None


def _check_marked(cluster: ChaosCluster, marker: str) -> None:
    """The end's "no process left" looks for ``marker`` in environments: check that the
    soak's processes, workers included, do carry it."""
    marked = set(processes_with_env(marker))
    workers = [pid for node in NODES for pid in cluster.workers_of(node)]
    members = [m.process.pid for m in cluster.etcd.members.values() if m.process is not None]
    coordinators = [c.process.pid for c in cluster.coordinators.values() if c.process is not None]
    agents = [cluster.agent_pid(node) for node in NODES]
    unmarked = set(workers + members + coordinators + agents) - marked
    assert workers and not unmarked, (
        f"processes of the soak without {marker.split('=')[0]} in their environment: "
        f"{sorted(unmarked)} (workers found: {workers})")


def _finish(tally: Tally, procs: ProcessGroupRegistry, marker: str, tmp_path: Path) -> list[int]:
    """Stop every process group the soak started; wait until none of theirs is left;
    save the report. Returns the pids still alive after the deadline."""
    procs.stop_all()
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not processes_with_env(marker), timeout=20, interval=0.2,
                 what="every process of the soak gone")
    leftovers = processes_with_env(marker)
    tally.leftover_processes = len(leftovers)
    for pid in leftovers:  # counted as a failure; still, leave nothing behind
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    path = Path(os.environ.get("TIDAL_CHAOS_REPORT") or tmp_path / "chaos-report.json")
    tally.save(path)
    log.info("chaos report saved to %s", path)
    return leftovers
