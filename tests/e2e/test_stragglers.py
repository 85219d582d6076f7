"""A slow node is found and taken out of the job live, losing nothing (#27).

A real coordinator and four real agents (a, b, c, d) run examples/mlp.py
--live-resize, compute-bound (no pause between steps), min 2 / max 3: it starts
on a, b and c; d is the spare. Once the job trains, c is made slow: its workers
take 1 s more in each step's forward and backward (mlp.py's ``--slow-node``,
while the test's slow file exists), several times their own work. The
checkpoints library measures each rank's own pace, the runner reports each
node's, and the coordinator's pass finds c a straggler and evicts it: c's runner
leaves by the live path, a and b re-form in place (resized_live), d takes the
slot, and c shows ``slow`` in ``GET /v1/nodes``. Rank 0 logs every step exactly
once (0 steps lost, none redone). Before that, neither every node alike nor c
with single slow steps (SIGSTOPped 0.6 s every 3 s: noisy, not slower) evicts anything.

Why a pause and not a CPU throttle: a SIGSTOP/SIGCONT duty cycle on c's workers
(stopped two thirds of every 40 ms, :class:`Throttle`) measured c at 2.1x its
peers alone, but at 1.32x with two busy loops beside the test (the scheduler
gives a task that was stopped its CPU back first, ahead of the tasks that kept
running), and a CI run, with another scenario test on the same two cores, took
83 steps to cross the factor of 1.3. The pause is slow by the same amount
whoever else runs (a 0.5 s pause measured c at 1.35x to 3.15x with the busy
loops: 1 s keeps c over the factor while its peers' steps take up to 3 s).
The benchmark (tests/bench/bench_stragglers.py), on a quiet machine, keeps the
duty cycle.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd.server import EtcdServer
from tests.e2e.test_live_resize import job_events, running_at, steps
from tests.support.acid import MLP
from tests.support.agents import AgentCluster, warm_runner_ready
from tests.support.coordinator import CoordinatorProcess, coordinator_and_agents, job_view
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
# Compute-bound: two 1024-wide layers, 768 samples a rank; no pause between steps. A
# step takes about 0.3 s here: the pace reaches the coordinator within a few seconds
# (progress file, status record, a pass), which must be a few steps, as on a real job.
ARGS = ["--global-batch-size", "2304", "--dataset-size", "23040", "--features", "512",
        "--hidden", "1024", "--every-steps", "1000", "--seed", "3", "--total-steps", "100000"]
WINDOW = 20


class Throttle:
    """Runs ``pids`` at about ``1 - stopped`` of their speed: each ``period_s``, stopped
    (SIGSTOP) for ``stopped`` of it, then continued (SIGCONT). :meth:`stop` continues them."""

    def __init__(self, pids: list[int], *, period_s: float = 0.04, stopped: float = 0.67) -> None:
        self.pids, self.period_s, self.stopped = pids, period_s, stopped
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                self._signal(signal.SIGSTOP)
                self._done.wait(self.period_s * self.stopped)
                self._signal(signal.SIGCONT)
                self._done.wait(self.period_s * (1 - self.stopped))
        finally:
            self._signal(signal.SIGCONT)

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)


def worker_pids(run_dir: Path, job_id: str) -> list[int]:
    """The PIDs the node's workers wrote in their progress files (checkpoints.protocol)."""
    pids = []
    for path in sorted(run_dir.glob(f"jobs/{job_id}/gen-*/progress/rank-*.json")):
        try:
            pids.append(int(json.loads(path.read_text())["pid"]))
        except (OSError, ValueError, KeyError):
            continue
    return sorted({p for p in pids if Path(f"/proc/{p}").exists()})


def rank0_steps(root: Path, *, size: int | None = None, after: float = 0.0) -> list[Any]:
    return [s for s in steps(root) if s.rank == 0 and s.time > after
            and (size is None or s.world_size == size)]


def step_time(root: Path, *, after: float, before: float, size: int) -> float:
    """The median time between rank 0's consecutive steps at ``size`` in (after, before)."""
    times = [s.time for s in rank0_steps(root, size=size, after=after) if s.time < before]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


@pytest.fixture
def cluster(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry,
) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    with coordinator_and_agents(tmp_path=tmp_path, etcd_server=etcd_server,
                                etcd_root=etcd_root, procs=procs) as both:
        yield both


def evictions(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return [e for e in job_events(api, job_id) if e["reason"] == "straggler_evicted"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_slow_node_is_evicted_live_and_the_spare_takes_its_slot(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster],
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    for node in "abcd":
        agents.start_agent(node)
    wait_for(lambda: {n["node_id"] for n in api.get("/v1/nodes").json()} == set("abcd"),
             timeout=60, what="nodes a, b, c, d registered")
    wait_for(lambda: all(warm_runner_ready(tmp_path / n) for n in "abcd"), timeout=240,
             what="every agent's warm runner ready")
    slow_file = tmp_path / "c-is-slow"
    command = [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"), *ARGS,
               "--live-resize", "--slow-node", "c", "--slow-file", str(slow_file),
               "--slow-seconds", "1.0"]
    response = api.post("/v1/jobs", json={
        "name": "stragglers", "command": command, "env": {"OMP_NUM_THREADS": "1"},
        "min_nodes": 2, "max_nodes": 3, "grace_period_s": 20,
        "straggler_policy": {"mode": "evict", "factor": 1.3, "window_steps": WINDOW},
    })
    assert response.status_code == 201, response.text
    job_id = response.json()["job_id"]
    wait_for(lambda: running_at(api, job_id, {"a", "b", "c"}), timeout=120,
             what="the job RUNNING on a, b and c")
    # a, b and c start new warm runners for their next jobs, which import torch on
    # the job's two cores: every node is slow and noisy until they are up.
    wait_for(lambda: all(warm_runner_ready(tmp_path / n) for n in "abc"), timeout=120,
             what="a's, b's and c's new warm runners ready")
    # A full window with every node alike: nobody is a straggler.
    wait_for(lambda: len(rank0_steps(tmp_path, size=3)) >= WINDOW + 10, timeout=120,
             what=f"{WINDOW + 10} steps at world size 3")
    assert evictions(api, job_id) == [], evictions(api, job_id)

    pids = wait_for(lambda: worker_pids(tmp_path / "c", job_id), timeout=10,
                    what="c's worker pids in its progress files")
    # Noisy, not slower: c stops for 0.6 s every 3 s, a spike in one step of about
    # fifteen. A full window of that is no straggler either.
    spiked = len(rank0_steps(tmp_path))
    spikes = Throttle(pids, period_s=3.0, stopped=0.2).start()
    try:
        wait_for(lambda: len(rank0_steps(tmp_path)) >= spiked + WINDOW + 10, timeout=120,
                 what=f"{WINDOW + 10} steps with c spiking")
    finally:
        spikes.stop()
    assert evictions(api, job_id) == [], evictions(api, job_id)

    throttled_at = time.time()
    first_slow = rank0_steps(tmp_path)[-1].step + 1
    slow_file.touch()
    try:
        (evicted,) = wait_for(lambda: evictions(api, job_id), timeout=120,
                              what="c evicted as a straggler")
    finally:
        slow_file.unlink(missing_ok=True)
    evicted_at = time.time()
    assert evicted["nodes"] == ["c"], evicted
    detected = [s for s in rank0_steps(tmp_path) if s.time <= evicted_at][-1].step
    steps_to_detection = detected - first_slow + 1
    log.info("c evicted after %d slow steps: %s", steps_to_detection, evicted["message"])

    # The spare takes the slot; a and b re-formed in place; c shows slow.
    wait_for(lambda: running_at(api, job_id, {"a", "b", "d"}), timeout=120,
             what="the job RUNNING on a, b and d")
    # The coordinator tells the path from the nodes' status records, a pass later.
    reasons = wait_for(lambda: (r := [e["reason"] for e in job_events(api, job_id)])
                       and "resized_live" in r and r, timeout=30,
                       what="the resized_live event", interval=0.2)
    assert "resized_by_restart" not in reasons, reasons
    slow = {n["node_id"]: n["slow"] for n in api.get("/v1/nodes").json()}
    assert set(k for k, v in slow.items() if v) == {"c"}, slow
    assert slow["c"]["job_id"] == job_id and slow["c"]["ratio"] >= 1.3, slow["c"]

    # c and d each start a new warm runner (d's was taken, c's job left), which import
    # torch on the same two cores: the job's pace with d is taken once they are up,
    # and after d's own first steps (first allocations, the optimizer's imports).
    wait_for(lambda: all(warm_runner_ready(tmp_path / n) for n in "cd"), timeout=120,
             what="c's and d's new warm runners ready")
    joined = time.time()
    with_d = wait_for(lambda: (s := rank0_steps(tmp_path, size=3, after=joined))[25:] and s,
                      timeout=120, what="25 steps at world size 3 with d")
    before = step_time(tmp_path, after=0.0, before=throttled_at, size=3)
    during = step_time(tmp_path, after=throttled_at, before=evicted_at, size=3)
    after = step_time(tmp_path, after=with_d[4].time, before=with_d[25].time, size=3)
    log.info("step time: %.3f s before, %.3f s with c slow, %.3f s after (%.2fx before); "
             "detected after %d steps", before, during, after, after / before,
             steps_to_detection)

    api.post(f"/v1/jobs/{job_id}/cancel")
    wait_for(lambda: job_view(api, job_id)["phase"] == "CANCELLED", timeout=120,
             what="the job CANCELLED")
    # 0 steps lost, none redone: rank 0 logged each step once, with no gap.
    taken = Counter(s.step for s in rank0_steps(tmp_path))
    assert max(taken.values()) == 1, [k for k, v in taken.items() if v > 1]
    assert sorted(taken) == list(range(min(taken), max(taken) + 1))
    # How fast (the target: within 20 steps) and how well the job's pace comes
    # back are the benchmark's to measure (tests/bench/bench_stragglers.py), and only
    # logged here: in make test other scenario tests share the two cores, and a rank's
    # wall-clock step time is mostly theirs (a CI run measured 0.46 s a step before the
    # throttle, 0.35 s during it and 0.40 s after). What does not depend on the
    # neighbours: c's own pace against its peers' (the slow record's ratio, above), and
    # that c was found while it was slow (a window's worth of slow steps, and the few
    # seconds a pace takes to reach the coordinator).
    assert steps_to_detection <= 4 * WINDOW, steps_to_detection
