"""The acid test through planned resizes taken live: joins, a drain and two PATCHes.

A real coordinator schedules examples/mlp.py --live-resize (float64, the
checkpoints library, DDP over gloo) on real agents. The job starts on a and b
(max_nodes 2) while c's agent is up and idle and d's is up but drained; then,
each change once the job trains at the size the previous one led to
(:func:`planned_changes`):

1. PATCH max_nodes 3: c joins (world size 3);
2. b is drained: it leaves (2, on a and c);
3. d is put back in service: it joins (3);
4. PATCH max_nodes 2: d, the newest, is released (2).

Every agent is up before the job starts, so that a loaded machine's slow agent
start cannot outlast the job's steps; tests/bench/bench_recovery.py makes the
third change a cold join (d's agent starts then) and measures the pauses.

Each change is taken on the live path, and the status records of the nodes
that stayed, the job's events and the agent's metrics say so; the
workers of a node that stays are never restarted, every step is taken exactly
once (0 completed steps lost, none redone), and the final parameters equal
those of the same job run uninterrupted under plain torchrun. The same kind of
change with a script that does not use live resize (mlp.py without
--live-resize) takes today's restart path, and they say that too, and why.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import free_port
from tests.support.acid import (
    MLP,
    assert_same_params,
    max_difference,
    record_params,
    start_reference,
    wait_reference,
)
from tests.support.agents import AgentCluster, statuses, warm_runner_ready
from tests.support.coordinator import CoordinatorProcess, job_view
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
ARGS = [
    "--global-batch-size", "10", "--dataset-size", "96", "--dtype", "float64",
    "--every-steps", "20", "--seed", "5",
]
STEP_SECONDS = 0.1
STEADY_STEPS = 5  # steps at a new size before the next change, so that pauses stay apart
CHANGE_DEADLINE_S = 120.0  # from a change to the first step at its size (a cold agent's start)


# Reading the workers' logs --------------------------------------------------------

# mlp.py logs "<asctime> [rank R] rank R world_size W step S loss L" after step S.
_STEP = re.compile(r"rank (\d+) world_size (\d+) step (\d+) loss")


@dataclass(frozen=True)
class Step:
    """One rank's log line for one completed step."""

    time: float  # when the line was logged (time.time(), to the millisecond)
    node: str
    rank: int
    world_size: int
    step: int


def _stamp(line: str) -> float | None:
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def worker_logs(root: Path) -> dict[str, list[Path]]:
    """node -> every worker log file (stderr) of every generation the agents under ``root`` ran."""
    out: dict[str, list[Path]] = {}
    for path in sorted(root.glob("*/jobs/*/gen-*/logs/**/stderr.log")):
        out.setdefault(path.relative_to(root).parts[0], []).append(path)
    return out


def worker_lines(root: Path) -> dict[str, list[str]]:
    return {
        node: [line for p in paths for line in p.read_text(errors="replace").splitlines()]
        for node, paths in worker_logs(root).items()
    }


def steps(root: Path) -> list[Step]:
    """Every step line the workers logged, in time order."""
    out = []
    for node, lines in worker_lines(root).items():
        for line in lines:
            match = _STEP.search(line)
            stamp = _stamp(line)
            if match is not None and stamp is not None:
                rank, size, step = (int(g) for g in match.groups())
                out.append(Step(stamp, node, rank, size, step))
    return sorted(out, key=lambda s: (s.time, s.step))


def first_step_at(root: Path, size: int, *, after: float) -> Step | None:
    """The first step logged at world size ``size`` after ``after``."""
    return next((s for s in steps(root) if s.time > after and s.world_size == size), None)


def steps_at(root: Path, size: int, *, after: float) -> set[int]:
    return {s.step for s in steps(root) if s.time > after and s.world_size == size}


# The job and its planned changes ----------------------------------------------------


def mlp_spec(tmp_path: Path, *, live: bool, total_steps: int, record: Path | None = None,
             step_seconds: float = STEP_SECONDS) -> dict[str, Any]:
    """examples/mlp.py as a job of 1 to 2 nodes, pausing ``step_seconds`` after each step."""
    command = [sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"), *ARGS,
               "--total-steps", str(total_steps), "--step-seconds", str(step_seconds)]
    if live:
        command.append("--live-resize")
    if record is not None:
        command += ["--record", str(record)]
    return {
        "name": "live" if live else "restart", "command": command,
        "env": {"OMP_NUM_THREADS": "1"},
        "min_nodes": 1, "max_nodes": 2, "grace_period_s": 20,
    }


def running_at(api: httpx.Client, job_id: str, nodes: set[str]) -> bool:
    """Whether every node of ``nodes``, and no other, runs the job at world size len(nodes)."""
    view = job_view(api, job_id)
    return (view["phase"] == "RUNNING" and view["world_size"] == len(nodes)
            and {n["node_id"] for n in view["nodes"]} == nodes
            and all(n["state"] == "running" for n in view["nodes"]))


def drain(api: httpx.Client, node: str, *, on: bool = True) -> None:
    """Take ``node`` out of service (``on``), or put it back."""
    response = (api.post if on else api.delete)(f"/v1/nodes/{node}/drain")
    assert response.status_code == 200, response.text


def start_job(api: httpx.Client, agents: AgentCluster, root: Path, spec: dict[str, Any],
              *, spares: tuple[str, ...], metrics_port: int | None = None) -> str:
    """Start agents a (serving its metrics on ``metrics_port``), b and ``spares``;
    once every warm runner is ready, submit ``spec`` (max_nodes 2) with the spares
    drained, and return the job's id once it trains on a and b. The first spare is
    then put back in service (idle: the job is at its maximum); the others stay
    drained."""
    agents.start_agent("a", metrics_port=metrics_port)
    for node in ("b", *spares):
        agents.start_agent(node)
    nodes = {"a", "b", *spares}
    wait_for(lambda: {n["node_id"] for n in api.get("/v1/nodes").json()} == nodes,
             timeout=60, what=f"nodes {sorted(nodes)} registered")
    wait_for(lambda: all(warm_runner_ready(root / n) for n in nodes), timeout=240,
             what="every agent's warm runner ready")
    for node in spares:
        drain(api, node)
    response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id: str = response.json()["job_id"]
    wait_for(lambda: running_at(api, job_id, {"a", "b"}), timeout=120,
             what="the job RUNNING on a and b")
    wait_for(lambda: len(steps_at(root, 2, after=0)) >= STEADY_STEPS, timeout=120,
             what=f"{STEADY_STEPS} steps at world size 2")
    if spares:
        drain(api, spares[0], on=False)
    return job_id


@dataclass(frozen=True)
class Change:
    """One planned change, made at ``at`` (time.time()); the job logged its first
    step at the ``size`` it leads to at ``reached``. ``paths``: the path each node
    in the job before and after it says it took (its status record's last_resize:
    "live", or "restart (<why>)"); ``events``: the job's events that say so."""

    name: str
    size: int
    at: float
    reached: float
    paths: dict[str, str]
    events: list[str]  # the job's events saying the path, "reason: message"


def resizes(client: EtcdClient, job_id: str) -> dict[str, tuple[int, str | None]]:
    """node -> (membership changes its runner handled, the path of the last), from
    the nodes' status records (what the coordinator reads)."""
    return {node: (sum(st.resize_paths.values()), st.last_resize)
            for node, st in statuses(client, job_id).items()}


def paths_after(client: EtcdClient, job_id: str, nodes: set[str],
                before: dict[str, tuple[int, str | None]], what: str) -> dict[str, str]:
    """The paths ``nodes`` took for one more change than ``before`` counted."""

    def counted() -> dict[str, str] | None:
        now = resizes(client, job_id)
        if all(n in now and now[n][0] > before.get(n, (0, None))[0] for n in nodes):
            return {n: str(now[n][1]) for n in nodes}
        return None

    found = wait_for(counted, timeout=CHANGE_DEADLINE_S, what=f"{sorted(nodes)} counting {what}")
    assert found is not None
    return found


RESIZE_EVENTS = ("resized_live", "resized_by_restart")


def job_events(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    response = api.get(f"/v1/jobs/{job_id}/events")
    assert response.status_code == 200, response.text
    return list(response.json()["events"])


def resize_events(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """The job's events that say which path a membership change took, oldest first."""
    return [e for e in job_events(api, job_id) if e["reason"] in RESIZE_EVENTS]


def events_after(api: httpx.Client, job_id: str, nodes: set[str], seen: int,
                 what: str) -> list[str]:
    """The job's path events after its first ``seen``, once they name every node of
    ``nodes``, as "reason: message"."""

    def named() -> list[dict[str, Any]] | None:
        new = resize_events(api, job_id)[seen:]
        return new if nodes <= {n for e in new for n in e["nodes"]} else None

    found = wait_for(named, timeout=CHANGE_DEADLINE_S, what=f"events naming {sorted(nodes)} "
                     f"for {what}")
    assert found is not None
    return [f"{e['reason']}: {e['message']}" for e in found]


def planned_changes(api: httpx.Client, agents: AgentCluster, client: EtcdClient, root: Path,
                    job_id: str, done: list[Change], *, cold: bool) -> None:
    """Make the four changes of the module's docstring, on a job :func:`start_job`
    started with spares c and d (or c alone if ``cold``), appending each to
    ``done`` once the job trains at its size. The second join is d put back in
    service, or, if ``cold``, d's agent starting.

    Raises:
        TimeoutError: a change did not lead to its size in time (``done`` has those before).
    """
    members = {"a", "b"}

    def change(name: str, nodes: set[str], make: Any) -> None:
        nonlocal members
        before, seen = resizes(client, job_id), len(resize_events(api, job_id))
        at = time.time()
        make()
        size = len(nodes)
        first = wait_for(lambda: first_step_at(root, size, after=at), timeout=CHANGE_DEADLINE_S,
                         what=f"a step at world size {size} after '{name}'")
        assert first is not None
        paths = paths_after(client, job_id, members & nodes, before, f"'{name}'")
        said = events_after(api, job_id, members & nodes, seen, f"'{name}'")
        done.append(Change(name, size, at, first.time, paths, said))
        log.info("%s: first step at world size %d %.2f s after it; paths %s",
                 name, size, first.time - at, paths)
        wait_for(lambda: running_at(api, job_id, nodes), timeout=CHANGE_DEADLINE_S,
                 what=f"the job RUNNING on {sorted(nodes)} after '{name}'")
        members = nodes
        wait_for(lambda: len(steps_at(root, size, after=at)) >= STEADY_STEPS,
                 timeout=CHANGE_DEADLINE_S, what=f"{STEADY_STEPS} steps after '{name}'")

    def patch(max_nodes: int) -> None:
        response = api.patch(f"/v1/jobs/{job_id}", json={"max_nodes": max_nodes})
        assert response.status_code == 200, response.text

    change("join, node up", {"a", "b", "c"}, lambda: patch(3))
    change("drain", {"a", "c"}, lambda: drain(api, "b"))
    if cold:
        change("join, cold", {"a", "c", "d"}, lambda: agents.start_agent("d"))
    else:
        change("join, back in service", {"a", "c", "d"}, lambda: drain(api, "d", on=False))
    change("PATCH scale-down", {"a", "c"}, lambda: patch(2))


def path_taken(change: Change) -> str:
    """The paths the nodes that stayed say ``change`` took, e.g. "live" or
    "restart (not_capable)" (several, comma-separated, where they differ)."""
    return ", ".join(sorted(set(change.paths.values())))


def event_reasons(change: Change) -> str:
    """The reasons of the events that say which path ``change`` took, comma-separated."""
    return ", ".join(sorted({e.partition(":")[0] for e in change.events}))


def agent_metrics(port: int, job_id: str) -> dict[tuple[str, ...], float]:
    """An agent's samples of ``job_id``: (name, label values but the job's) -> value."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (sample.name, *(v for k, v in sorted(sample.labels.items()) if k != "job_id")): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
        if sample.labels.get("job_id") == job_id
    }


# The tests ----------------------------------------------------------------------------


# Enough steps for the four changes with room to spare: every node is up before
# the job starts, and the changes took about 15 s at a load of 30 on 2 cores,
# with a step every 0.065 s.
TOTAL_STEPS, TEST_STEP_SECONDS = 600, 0.05


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_joins_a_drain_and_two_patches_taken_live_end_with_the_uninterrupted_parameters(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    reference, reference_record = start_reference(
        procs, tmp_path, [*ARGS, "--total-steps", str(TOTAL_STEPS)])
    record, port = tmp_path / "live.json", free_port()
    job_id = start_job(api, agents, tmp_path,
                       mlp_spec(tmp_path, live=True, total_steps=TOTAL_STEPS, record=record,
                                step_seconds=TEST_STEP_SECONDS),
                       spares=("c", "d"), metrics_port=port)
    changes: list[Change] = []
    planned_changes(api, agents, etcd_client, tmp_path, job_id, changes, cold=False)
    # Each change on the live path, as the status records of the nodes that
    # stayed, the job's events and node a's metrics (one per change, none on
    # the restart path) say.
    names = ["join, node up", "drain", "join, back in service", "PATCH scale-down"]
    assert {c.name: path_taken(c) for c in changes} == dict.fromkeys(names, "live"), changes
    assert {c.name: event_reasons(c) for c in changes} == dict.fromkeys(
        names, "resized_live"), changes

    def by_mode() -> dict[str, float]:
        samples = agent_metrics(port, job_id)
        return {mode: sum(v for k, v in samples.items()
                          if k[:2] == ("tidal_agent_job_resizes_total", mode))
                for mode in ("live", "restart")}

    wait_for(lambda: by_mode() == {"live": 4, "restart": 0}, timeout=30,
             what="a's metrics counting 4 live resizes and no restart")
    wait_for(lambda: job_view(api, job_id)["phase"] == "SUCCEEDED", timeout=300,
             what="the job SUCCEEDED")
    # Nothing in the job's history says it restarted.
    reasons = {e["reason"] for e in job_events(api, job_id)}
    assert "resized_live" in reasons and not reasons & {"resized_by_restart", "restarted"}, reasons
    wait_reference(reference, tmp_path, timeout=120)

    # 0 completed steps lost, none redone: rank 0 logged every step exactly once.
    taken = Counter(s.step for s in steps(tmp_path) if s.rank == 0)
    assert sorted(taken) == list(range(TOTAL_STEPS)), sorted(set(range(TOTAL_STEPS)) - set(taken))
    assert max(taken.values()) == 1, [k for k, v in taken.items() if v > 1]
    # The workers of a node that stayed were never restarted: each node's worker
    # started once (a and b at the start, c and d when they joined).
    lines = worker_lines(tmp_path)
    starts = {node: sum("start at step" in line for line in lines[node]) for node in lines}
    assert starts == {"a": 1, "b": 1, "c": 1, "d": 1}, starts

    got, want = record_params(record), record_params(reference_record)
    log.info("max abs parameter difference vs the uninterrupted run: %.3g",
             max_difference(got, want))
    assert_same_params(got, want)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_without_live_resize_takes_the_restart_path_and_says_so(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    port = free_port()
    job_id = start_job(api, agents, tmp_path, mlp_spec(tmp_path, live=False, total_steps=100_000),
                       spares=("c",), metrics_port=port)
    before, seen = resizes(etcd_client, job_id), len(resize_events(api, job_id))
    at = time.time()
    assert api.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 3}).status_code == 200
    wait_for(lambda: first_step_at(tmp_path, 3, after=at), timeout=CHANGE_DEADLINE_S,
             what="a step at world size 3")
    paths = paths_after(etcd_client, job_id, {"a", "b"}, before, "c's join")
    said = events_after(api, job_id, {"a", "b"}, seen, "c's join")
    # The workers never announced the live path: a and b restarted them, from
    # the checkpoint they saved at their stop (the step after the last completed).
    assert paths == {"a": "restart (not_capable)", "b": "restart (not_capable)"}, paths
    assert said and all(e.startswith("resized_by_restart: ") and e.endswith(": not_capable")
                        for e in said), said
    wait_for(lambda: {("tidal_agent_job_resizes_total", "restart", "join"),
                      ("tidal_agent_job_live_fallbacks_total", "not_capable")}
             <= {k for k, v in agent_metrics(port, job_id).items() if v == 1},
             timeout=30, what="a's metrics counting a restart for a join, as not capable")
    lines = worker_lines(tmp_path)
    assert all(sum("start at step" in line for line in lines[n]) == 2 for n in ("a", "b")), lines
    last_at_2 = max(s.step for s in steps(tmp_path) if s.world_size == 2)
    resumed = {int(m.group(1)) for line in lines["c"]
               if (m := re.search(r"start at step (\d+) .*world_size 3$", line))}
    assert resumed == {last_at_2 + 1}, (resumed, last_at_2)
