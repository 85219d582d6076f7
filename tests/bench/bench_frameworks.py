"""Benchmark: a Hugging Face Trainer job and a Lightning job under `tidal up`, with and
without tidal's callback, through a kill, a join, a PATCH and a drain (issue #26).

Run with
``flock /tmp/tidal-quiet.lock .venv/bin/python -m pytest tests/bench/bench_frameworks.py \
-m bench -s``
(``BENCH_FRAMEWORKS=hf`` or ``lightning`` to run one framework;
``BENCH_FRAMEWORKS_ARMS=on`` or ``off`` one arm).

For each framework (examples/hf_trainer.py: a tiny GPT-2 built from a config;
examples/lightning_trainer.py: a tiny ``LightningModule``; CPU, gloo, nothing
downloaded) and each arm (the script with tidal's ``TidalCallback``, and the
same script with ``--no-callback``), in the same run: a real ``tidal up
--agents 3`` in a state directory of its own, and one job (min 2, max 3 nodes,
the framework named in ``zygote_preload``, the framework's own checkpoint
every 25 steps, a step paced at 0.1 s, ``grace_period_s`` 15) submitted
through the coordinator's API. Once it trains at world size 3, each event is
made and waited for by condition, with a deadline, before the next one:

1. **kill**: one node's agent (not rank 0's) is SIGKILLed with its whole
   process group, as a dying machine (its runner and workers die with it);
2. **join**: `tidal up` starts the killed agent again and the node comes back;
   the event is the coordinator's ``node_joined`` event for it (or, where the
   node came back before its lease ran out and the coordinator never dropped
   it, the new agent's start), and it is done at a new step at world size 3;
3. **PATCH**: ``PATCH /v1/jobs/{id}`` ``max_nodes`` 3 -> 2, done at a new step
   at world size 2;
4. **drain**: ``tidal drain NODE`` of a node of the job (not rank 0's), done at
   a new step of a training started after it (the third node takes its place).

Measured per event, from rank 0's own step records (``--events``: one JSON
line per completed step, and one as training starts with the step it resumed
from) and the coordinator's events for the job:

* **path**: ``live`` where the job's events after the event say
  ``resized_live``, ``restart`` where they say ``resized_by_restart`` or
  ``restarted``, with the reasons recorded;
* **steps redone**: the last step completed before training started again
  (the first training start after the event, at the event's world size)
  minus the step it resumed from;
* **gap**: from the event to the first *new* step (one past that last step),
  so it includes the restart and the steps redone; for a join it also holds
  the seconds the others trained on while the node's runner got ready;
* **pause**: from that last step to the first new step: how long the job did
  not advance.

Every event here takes the restart path (neither framework has the live path
yet): each is done at a new step of a training started after it.

Each job trains tens of seconds per phase; the whole run takes 10 to 15
minutes on the shared 2-core machine. Every process started here (``tidal
up`` leads a process group; its children lead theirs) is stopped at the end
of each job, on failure too. No assertion is made on time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client.target import ClusterFile, load_cluster
from tests.bench.bench_recovery import MARKER, Events, _load, _load_text, _no_leftovers
from tests.support.agents import warm_runner_ready
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
FRAMEWORKS = {
    "hf": (REPO / "examples" / "hf_trainer.py", ["transformers", "transformers.trainer"]),
    "lightning": (REPO / "examples" / "lightning_trainer.py", ["lightning"]),
}
ARMS = {"on": True, "off": False}
STEP_SECONDS = 0.1
SAVE_STEPS = 25  # the framework's own periodic checkpoint
GRACE_S = 15  # the job's grace_period_s: SIGTERM to SIGKILL
STEADY_STEPS = 30  # new steps at a size before the next event
UP_DEADLINE_S = 180.0  # tidal up ready, every warm runner ready
EVENT_DEADLINE_S = 180.0  # from an event to the first new step after it
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class Measured:
    """One event of one job: what the job did, from its step records and events."""

    event: str
    at: float  # time.time() of the event
    path: str = "-"
    last_done: int | None = None  # last step completed before training restarted
    resumed: int | None = None  # the step training resumed from (None: it did not restart)
    gap_s: float | None = None  # event -> first new step
    pause_s: float | None = None  # last step before the restart -> first new step
    reasons: list[str] = field(default_factory=list)

    @property
    def redone(self) -> int | None:
        if self.last_done is None or self.gap_s is None:
            return None
        return 0 if self.resumed is None else max(0, self.last_done - self.resumed)


@dataclass
class JobRun:
    framework: str
    callback: bool
    events: list[Measured] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# tidal up -----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """This environment without the caller's TIDAL_* settings (a TIDAL_TOKEN or TIDAL_HOME)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}


class Up:
    """A real ``tidal up --agents 3`` in ``state``, its API client, and its agents."""

    def __init__(self, state: Path, procs: ProcessGroupRegistry) -> None:
        self.state = state
        self.procs = procs
        self.log = state.parent / "up.log"
        self.process = procs.spawn(
            [sys.executable, "-m", "service.cli", "up", "--agents", "3",
             "--state-dir", str(state)],
            log_path=self.log, env=_env(), cwd=REPO,
        )
        first = wait_for(self.cluster, timeout=UP_DEADLINE_S, what=f"{state}/cluster.json")
        assert first is not None
        token = Path(str(first.token_file)).read_text().strip()
        self.api = httpx.Client(base_url=first.url, timeout=10,
                                headers={"Authorization": f"Bearer {token}"})
        nodes = {a.node_id for a in first.agents}
        wait_for(lambda: {n["node_id"] for n in self.api.get("/v1/nodes").json()} >= nodes,
                 timeout=UP_DEADLINE_S, what=f"nodes {sorted(nodes)} registered")
        wait_for(lambda: all(warm_runner_ready(a.run_dir) for a in first.agents),
                 timeout=UP_DEADLINE_S, what="every agent's warm runner ready")

    def cluster(self) -> ClusterFile | None:
        if self.process.poll() is not None:
            raise RuntimeError(f"tidal up exited with {self.process.returncode}; see {self.log}")
        return load_cluster(self.state)

    def agent_pid(self, node: str) -> int | None:
        cluster = self.cluster()
        entry = next((a for a in cluster.agents if a.node_id == node), None) if cluster else None
        return entry.pid if entry is not None and entry.metrics_port is not None else None

    def kill_agent(self, node: str) -> int:
        """SIGKILL ``node``'s agent's process group (it leads one); return its pid."""
        pid = self.agent_pid(node)
        assert pid is not None, f"{node} has no agent running"
        os.killpg(pid, signal.SIGKILL)
        return pid

    def drain(self, node: str) -> None:
        """``tidal drain NODE``, the CLI against this cluster's cluster.json."""
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", "drain", node, "--state-dir", str(self.state)],
            capture_output=True, text=True, timeout=60, env=_env(), cwd=REPO, check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def stop(self) -> None:
        """SIGTERM: tidal up stops everything it started; the registry kills what is left."""
        self.api.close()
        self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=60)


# The job --------------------------------------------------------------------------------


def job_spec(framework: str, callback: bool, out: Path) -> dict[str, Any]:
    script, preload = FRAMEWORKS[framework]
    command = ["python", str(script), "--out", str(out), "--events", str(out / "events.jsonl"),
               "--step-seconds", str(STEP_SECONDS), "--save-steps", str(SAVE_STEPS),
               "--max-steps", "1000000"]
    if not callback:
        command.append("--no-callback")
    return {
        "name": f"{framework}-{'callback' if callback else 'plain'}", "command": command,
        "working_dir": ".", "env": {"OMP_NUM_THREADS": "1"},
        "min_nodes": 2, "max_nodes": 3, "max_restarts": 20, "grace_period_s": GRACE_S,
        "zygote_preload": preload,
    }


def _stamp(iso: str) -> float:
    """An event's time (the API's ISO 8601, UTC) as time.time()."""
    when = datetime.fromisoformat(iso)
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


class Job:
    """One submitted job: its view, its events, rank 0's step records."""

    def __init__(self, up: Up, spec: dict[str, Any], out: Path) -> None:
        self.up = up
        out.mkdir(parents=True)
        self.records = Events(out / "events.jsonl")
        response = up.api.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        self.id: str = response.json()["job_id"]

    def view(self) -> dict[str, Any]:
        response = self.up.api.get(f"/v1/jobs/{self.id}")
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        if body["phase"] in TERMINAL:
            raise RuntimeError(f"job {self.id} ended: {body['phase']} ({body.get('error')})")
        return body

    def events(self) -> list[dict[str, Any]]:
        response = self.up.api.get(f"/v1/jobs/{self.id}/events")
        response.raise_for_status()
        return list(response.json()["events"])

    def steps(self, kind: str = "step") -> list[dict[str, Any]]:
        return [r for r in self.records.read() if r.get("kind") == kind]

    def rank0_node(self) -> str:
        steps = self.steps()
        return str(steps[-1]["node"]) if steps else ""

    def last_before(self, at: float) -> dict[str, Any] | None:
        """The last step completed before ``at``."""
        before = [r for r in self.steps() if r["time"] <= at]
        return before[-1] if before else None

    def restart_after(self, at: float, size: int | None) -> dict[str, Any] | None:
        """The first training start after ``at`` (at world size ``size``)."""
        return next((r for r in self.steps("start") if r["time"] > at
                     and (size is None or r["world_size"] == size)), None)

    def new_step(self, at: float, *, size: int | None = None, restarted: bool = False
                 ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None] | None:
        """The first new step after ``at`` (at world size ``size``): after the first
        training start after ``at`` if there is one (``restarted``: only then), one
        past the last step completed before that start (or before ``at``). Returns
        (that step, the start, the last step before the start) or None."""
        start = self.restart_after(at, size)
        if restarted and start is None:
            return None
        last = self.last_before(start["time"] if start else at)
        since = start["time"] if start else at
        past = -1 if last is None else int(last["step"])
        first = next((r for r in self.steps() if r["time"] > since and r["step"] > past
                      and (size is None or r["world_size"] == size)), None)
        return None if first is None else (first, start, last)

    def steady(self, at: float, size: int) -> None:
        """Wait for STEADY_STEPS new steps at ``size`` after ``at``, the job RUNNING at it."""
        wait_for(lambda: self.view()["phase"] == "RUNNING" and self.view()["world_size"] == size
                 and len([r for r in self.steps() if r["time"] > at
                          and r["world_size"] == size]) >= STEADY_STEPS,
                 timeout=EVENT_DEADLINE_S, interval=0.2,
                 what=f"{STEADY_STEPS} steps at world size {size}, RUNNING")

    def measure(self, m: Measured, *, size: int | None = None, restarted: bool = False) -> None:
        """Wait for the first new step after ``m``'s event; fill in the figures."""
        found = wait_for(lambda: self.new_step(m.at, size=size, restarted=restarted),
                         timeout=EVENT_DEADLINE_S, interval=0.1,
                         what=f"a new step after '{m.event}' (size {size})")
        assert found is not None
        first, start, last = found
        m.gap_s = first["time"] - m.at
        m.last_done = None if last is None else int(last["step"])
        m.resumed = None if start is None else int(start["step"])
        if last is not None:
            m.pause_s = first["time"] - last["time"]


def paths(events: list[dict[str, Any]], measured: list[Measured], until: float) -> None:
    """Each event's path and reasons, from the job's events between it and the next one."""
    for i, m in enumerate(measured):
        end = measured[i + 1].at if i + 1 < len(measured) else until
        mine = [e for e in events if m.at - 0.5 <= _stamp(e["time"]) < end]
        m.reasons = [f"{e['reason']}: {e['message']}" for e in mine]
        said = {e["reason"] for e in mine}
        if "resized_live" in said:
            m.path = "live"
        elif said & {"resized_by_restart", "restarted"}:
            m.path = "restart"


def run_job(framework: str, callback: bool, workdir: Path, procs: ProcessGroupRegistry) -> JobRun:
    """tidal up, one job through kill, join, PATCH and drain; tidal up stopped at the end."""
    run = JobRun(framework, callback)
    up = Up(workdir / "state", procs)
    job: Job | None = None
    try:
        job = Job(up, job_spec(framework, callback, workdir / "out"), workdir / "out")
        job.steady(0, 3)
        _events(up, job, run)
    except Exception as exc:  # a job that fails is reported, and the next one runs
        run.notes.append(f"{type(exc).__name__}: {exc}")
        print(f"\nlast lines of {up.log}:\n" + "\n".join(
            up.log.read_text(errors="replace").splitlines()[-30:]))
    finally:
        if job is not None:
            with contextlib.suppress(httpx.HTTPError, RuntimeError):
                paths(job.events(), run.events, time.time())
                up.api.post(f"/v1/jobs/{job.id}/cancel")
        up.stop()
    return run


def _events(up: Up, job: Job, run: JobRun) -> None:
    nodes = sorted(n["node_id"] for n in job.view()["nodes"])
    victim = [n for n in nodes if n != job.rank0_node()][-1]

    kill = Measured("kill", time.time())
    old_pid = up.kill_agent(victim)
    run.events.append(kill)
    job.measure(kill, restarted=True)

    back = wait_for(lambda: (pid := up.agent_pid(victim)) is not None and pid != old_pid
                    and pid, timeout=EVENT_DEADLINE_S, what=f"{victim}'s agent back")
    started = _process_start(int(back)) or time.time()

    def joined() -> float | None:
        said = [_stamp(e["time"]) for e in job.events() if e["reason"] == "node_joined"
                and victim in e.get("nodes", []) and _stamp(e["time"]) > kill.at]
        if said:
            return said[0]
        if job.view()["world_size"] == 3 and job.new_step(kill.at, size=3):
            return started  # back within its lease: the coordinator never dropped it
        return None

    join_at = wait_for(joined, timeout=EVENT_DEADLINE_S, interval=0.2,
                       what=f"{victim} joining the job again")
    assert join_at is not None
    join = Measured("join", join_at)
    run.events.append(join)
    job.measure(join, size=3, restarted=True)
    job.steady(join.at, 3)

    patch = Measured("PATCH", time.time())
    response = up.api.patch(f"/v1/jobs/{job.id}", json={"max_nodes": 2})
    assert response.status_code == 200, response.text
    run.events.append(patch)
    job.measure(patch, size=2, restarted=True)
    job.steady(patch.at, 2)

    left = sorted(n["node_id"] for n in job.view()["nodes"])
    drained = [n for n in left if n != job.rank0_node()][-1]
    drain = Measured("drain", time.time())
    up.drain(drained)
    run.events.append(drain)
    job.measure(drain, size=2, restarted=True)
    job.steady(drain.at, 2)


def _process_start(pid: int) -> float | None:
    """When ``pid`` started (time.time()), from /proc: field 22 is in clock ticks since boot."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


# The report --------------------------------------------------------------------------------


def report(runs: list[JobRun], loads: list[tuple[float, float, float]]) -> str:
    lines = [
        f"{_load_text(loads)}; a step every {STEP_SECONDS} s (sleep) plus compute; the "
        f"framework's own checkpoint every {SAVE_STEPS} steps; grace {GRACE_S} s",
        "",
        "| framework | callback | event | path | steps redone | gap (s) | pause (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for m in run.events:
            redone = "-" if m.redone is None else str(m.redone)
            gap = f"> {EVENT_DEADLINE_S:g}" if m.gap_s is None else f"{m.gap_s:.1f}"
            pause = "-" if m.pause_s is None else f"{m.pause_s:.1f}"
            lines.append(f"| {run.framework} | {'on' if run.callback else 'off'} | {m.event} "
                         f"| {m.path} | {redone} | {gap} | {pause} |")
    lines.append("")
    for run in runs:
        name = f"{run.framework}, callback {'on' if run.callback else 'off'}"
        for m in run.events:
            lines.append(f"{name}, {m.event}: last step before the restart {m.last_done}, "
                         f"resumed from {m.resumed}; events: {'; '.join(m.reasons) or '-'}")
        for note in run.notes:
            lines.append(f"{name}: {note}")
    return "\n".join(lines)


def _chosen(variable: str, known: list[str]) -> list[str]:
    wanted = [w.strip() for w in os.environ.get(variable, ",".join(known)).split(",")]
    return [k for k in known if k in wanted]


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    """This run's marker, inherited by everything started below (the sweep's needle)."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, value)
    return value


@pytest.mark.bench
@pytest.mark.timeout(2400)
def test_bench_frameworks_with_and_without_the_callback(tmp_path: Path, marker: str) -> None:
    runs: list[JobRun] = []
    loads = [_load()]
    for framework in _chosen("BENCH_FRAMEWORKS", list(FRAMEWORKS)):
        for arm in _chosen("BENCH_FRAMEWORKS_ARMS", list(ARMS)):
            workdir = tmp_path / f"{framework}-{arm}"
            workdir.mkdir()
            procs = ProcessGroupRegistry()
            began = time.monotonic()
            with _no_leftovers(procs, marker):
                run = run_job(framework, ARMS[arm], workdir, procs)
            runs.append(run)
            loads.append(_load())
            print(f"\n{framework}, callback {arm}: {len(run.events)} event(s) in "
                  f"{time.monotonic() - began:.0f} s, notes {run.notes} "
                  f"(1-min load {loads[-1][0]:.2f}; logs in {workdir})", flush=True)
    print("\n" + report(runs, loads))
    assert runs and all(len(r.events) == 4 and not r.notes for r in runs)

