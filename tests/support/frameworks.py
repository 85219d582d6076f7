"""Drive a Hugging Face Trainer or Lightning job under a real ``tidal up`` (issue #26).

The shared driver of tests/e2e/test_frameworks.py (which asserts on what it
measures) and tests/bench/bench_frameworks.py (which reports it): a real
``tidal up --agents 3`` in a state directory of its own (:class:`Up`), one job
of examples/hf_trainer.py or examples/lightning_trainer.py submitted through
the coordinator's API (:class:`Job`, :func:`job_spec`), and the events made
on it, each waited for by condition with a deadline (:func:`kill`,
:func:`join`, :func:`patch`, :func:`drain`), measured from rank 0's own step
records (``--events``: one JSON line per completed step, one as training
starts with the step it resumed from) and the coordinator's events.

Every process ``tidal up`` starts inherits a marker variable of its run
(:func:`leftovers`), so that whatever survives the end of a run is found and
killed, and a test can assert that nothing did.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import httpx

from service.client.target import ClusterFile, load_cluster
from tests.support.agents import warm_runner_ready
from tests.support.processes import ProcessGroupRegistry, processes_with_env
from tests.support.wait import wait_for

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
#: Each framework's example script and the modules its job's zygote preloads.
FRAMEWORKS = {
    "hf": (REPO / "examples" / "hf_trainer.py", ["transformers", "transformers.trainer"]),
    "lightning": (REPO / "examples" / "lightning_trainer.py", ["lightning"]),
}
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
MARKER = "TIDAL_FRAMEWORKS_RUN"  # in every process a run starts (not a TIDAL_ setting)


@dataclass
class Pace:
    """How fast a job trains and how long a run waits."""

    step_seconds: float = 0.1  # a sleep after each step
    save_steps: int = 25  # the framework's own periodic checkpoint
    grace_s: int = 15  # the job's grace_period_s: SIGTERM to SIGKILL
    steady_steps: int = 30  # new steps at a size before the next event
    up_deadline_s: float = 180.0  # tidal up ready, every warm runner ready
    event_deadline_s: float = 180.0  # from an event to the first new step after it


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


class JobEnded(RuntimeError):
    """The job reached a terminal phase while a run still waited on it."""


# Leftovers --------------------------------------------------------------------------------


def marked_pids(value: str) -> list[int]:
    """Live processes (not this one, not zombies) whose environment carries ``value``."""
    return processes_with_env(MARKER, value)


@contextlib.contextmanager
def leftovers(procs: ProcessGroupRegistry) -> Iterator[Callable[[], list[int]]]:
    """A marker for this run (put in the environment of everything started inside), and
    at the end every group started killed, then anything else marked that survived.

    Yields a function returning the marked processes still alive, for a test's
    assertion that ``tidal up`` stopped everything itself.
    """
    value = uuid.uuid4().hex
    before = os.environ.get(MARKER)
    os.environ[MARKER] = value
    try:
        yield lambda: marked_pids(value)
    finally:
        if before is None:
            os.environ.pop(MARKER, None)
        else:
            os.environ[MARKER] = before
        procs.stop_all()
        for pid in marked_pids(value):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# tidal up ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """This environment without the caller's TIDAL_* settings (a TIDAL_TOKEN or TIDAL_HOME)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_") or k == MARKER}


class Up:
    """A real ``tidal up --agents 3`` in ``state``, its API client, and its agents."""

    def __init__(self, state: Path, procs: ProcessGroupRegistry, *, deadline_s: float) -> None:
        self.state = state
        self.procs = procs
        self.log = state.parent / "up.log"
        self.process = procs.spawn(
            [sys.executable, "-m", "service.cli", "up", "--agents", "3",
             "--state-dir", str(state)],
            log_path=self.log, env=_env(), cwd=REPO,
        )
        started = wait_for(lambda: self.process.poll() is not None or load_cluster(state),
                           timeout=deadline_s, what=f"{state}/cluster.json")
        if started is True:  # it gave up: say why at once rather than at the deadline
            raise RuntimeError(f"tidal up exited with {self.process.returncode} while "
                               f"starting:\n{self.log_tail(8)}")
        first = self.cluster()
        assert first is not None
        token = Path(str(first.token_file)).read_text().strip()
        self.api = httpx.Client(base_url=first.url, timeout=10,
                                headers={"Authorization": f"Bearer {token}"})
        nodes = {a.node_id for a in first.agents}
        wait_for(lambda: {n["node_id"] for n in self.api.get("/v1/nodes").json()} >= nodes,
                 timeout=deadline_s, what=f"nodes {sorted(nodes)} registered")
        wait_for(lambda: all(warm_runner_ready(a.run_dir) for a in first.agents),
                 timeout=deadline_s, what="every agent's warm runner ready")

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

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no output)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM: tidal up stops everything it started; returns its exit code (None:
        it did not exit in ``timeout`` s; the registry kills what is left)."""
        self.api.close()
        self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout=timeout)
        return None


# The job ----------------------------------------------------------------------------------


def job_spec(framework: str, callback: bool, out: Path, pace: Pace, *,
             min_nodes: int = 2, max_nodes: int = 3) -> dict[str, Any]:
    """The job: ``framework``'s example with (or without) tidal's callback, its
    checkpoints in ``out``, rank 0's step records in ``out/events.jsonl``, and
    ``out/stop`` the file that ends it (:meth:`Job.finish`)."""
    script, preload = FRAMEWORKS[framework]
    command = ["python", str(script), "--out", str(out), "--events", str(out / "events.jsonl"),
               "--step-seconds", str(pace.step_seconds), "--save-steps", str(pace.save_steps),
               "--max-steps", "1000000", "--stop-file", str(out / "stop")]
    if not callback:
        command.append("--no-callback")
    return {
        "name": f"{framework}-{'callback' if callback else 'plain'}", "command": command,
        "working_dir": ".", "env": {"OMP_NUM_THREADS": "1"},
        "min_nodes": min_nodes, "max_nodes": max_nodes, "max_restarts": 20,
        "grace_period_s": pace.grace_s, "zygote_preload": preload,
    }


def stamp(iso: str) -> float:
    """An event's time (the API's ISO 8601, UTC) as time.time()."""
    when = datetime.fromisoformat(iso)
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


class Job:
    """One submitted job: its view, its events, rank 0's step records."""

    def __init__(self, up: Up, spec: dict[str, Any], out: Path, pace: Pace) -> None:
        self.up = up
        self.out = out
        self.pace = pace
        out.mkdir(parents=True)
        self.records_path = out / "events.jsonl"
        response = up.api.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        self.id: str = response.json()["job_id"]

    def view(self) -> dict[str, Any]:
        response = self.up.api.get(f"/v1/jobs/{self.id}")
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def events(self) -> list[dict[str, Any]]:
        response = self.up.api.get(f"/v1/jobs/{self.id}/events")
        response.raise_for_status()
        return list(response.json()["events"])

    def wait(self, condition: Callable[[], T | None], *, what: str,
             timeout: float | None = None, interval: float = 0.1) -> T:
        """Wait for ``condition``; fail at once (:class:`JobEnded`) if the job ends first."""
        ended: list[dict[str, Any]] = []

        def check() -> T | bool | None:
            value = condition()
            if value:
                return value
            body = self.view()
            if body["phase"] in TERMINAL:
                ended.append(body)
                return True
            return value

        found = wait_for(check, timeout=self.pace.event_deadline_s if timeout is None
                         else timeout, interval=interval, what=what)
        if ended:
            body = ended[0]
            raise JobEnded(f"job {self.id} ended {body['phase']} ({body.get('error')}) "
                           f"while waiting for {what}")
        return found  # type: ignore[return-value]

    def steps(self, kind: str = "step") -> list[dict[str, Any]]:
        """Rank 0's records of ``kind`` (the file is small: read whole each time)."""
        if not self.records_path.exists():
            return []
        records = []
        for line in self.records_path.read_bytes().splitlines(keepends=True):
            if line.endswith(b"\n"):  # a line being written waits for the next read
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return [r for r in records if r.get("kind") == kind]

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
        """Wait for ``steady_steps`` new steps at ``size`` after ``at``, RUNNING at it."""
        def done() -> bool:
            if len([r for r in self.steps() if r["time"] > at
                    and r["world_size"] == size]) < self.pace.steady_steps:
                return False
            body = self.view()
            return bool(body["phase"] == "RUNNING" and body["world_size"] == size)

        self.wait(done, what=f"{self.pace.steady_steps} steps at world size {size}, RUNNING")

    def measure(self, m: Measured, *, size: int | None = None, restarted: bool = False) -> None:
        """Wait for the first new step after ``m``'s event; fill in the figures."""
        first, start, last = self.wait(
            lambda: self.new_step(m.at, size=size, restarted=restarted),
            what=f"a new step after '{m.event}' (size {size})")
        m.gap_s = first["time"] - m.at
        m.last_done = None if last is None else int(last["step"])
        m.resumed = None if start is None else int(start["step"])
        if last is not None:
            m.pause_s = first["time"] - last["time"]

    def finish(self, after: int = 5) -> dict[str, Any]:
        """End the job: every rank stops after the step ``after`` steps past the last
        one recorded (the examples' ``--stop-file``); wait for a terminal phase."""
        steps = self.steps()
        last = int(steps[-1]["step"]) if steps else 0
        stop = self.out / "stop"
        stop.with_suffix(".tmp").write_text(str(last + after))
        stop.with_suffix(".tmp").rename(stop)  # every rank reads the whole number
        def ended() -> dict[str, Any] | None:
            body = self.view()
            return body if body["phase"] in TERMINAL else None

        found = wait_for(ended, timeout=self.pace.event_deadline_s, interval=0.2,
                         what=f"job {self.id} to end")
        assert found is not None
        return found


def paths(events: list[dict[str, Any]], measured: list[Measured], until: float) -> None:
    """Each event's path and reasons, from the job's events between it and the next one
    (or its first new step, if that came later: a node back within its lease joins
    before the kill's restart is reported)."""
    for i, m in enumerate(measured):
        end = measured[i + 1].at if i + 1 < len(measured) else until
        if m.gap_s is not None:
            end = max(end, m.at + m.gap_s + 0.5)
        mine = [e for e in events if m.at - 0.5 <= stamp(e["time"]) < end]
        m.reasons = [f"{e['reason']}: {e['message']}" for e in mine]
        said = {e["reason"] for e in mine}
        if "resized_live" in said:
            m.path = "live"
        elif said & {"resized_by_restart", "restarted"}:
            m.path = "restart"


# The events -------------------------------------------------------------------------------


def _process_start(pid: int) -> float | None:
    """When ``pid`` started (time.time()), from /proc: field 22 is in clock ticks since boot."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def _not_rank0(job: Job) -> str:
    """A node of the job that does not hold rank 0 (the last by name)."""
    nodes = sorted(n["node_id"] for n in job.view()["nodes"])
    return str([n for n in nodes if n != job.rank0_node()][-1])


def kill(up: Up, job: Job) -> tuple[Measured, str, int]:
    """SIGKILL the agent (with its process group) of a node not holding rank 0, as a
    dying machine; done at a new step of a training started after it. Returns the
    measure, the node and the killed agent's pid."""
    victim = _not_rank0(job)
    m = Measured("kill", time.time())
    pid = up.kill_agent(victim)
    job.measure(m, restarted=True)
    return m, victim, pid


def join(up: Up, job: Job, node: str, old_pid: int, since: float) -> Measured:
    """``tidal up`` restarts ``node``'s killed agent (pid ``old_pid``) and the node comes
    back; the event is the coordinator's ``node_joined`` for it after ``since`` (or,
    where it came back before its lease ran out and was never dropped, the new
    agent's start); done at a new step of a training started after it at size 3."""
    back = job.wait(lambda: (pid := up.agent_pid(node)) is not None and pid != old_pid
                    and pid, what=f"{node}'s agent back")
    started = _process_start(int(back)) or time.time()

    def joined() -> float | None:
        said = [stamp(e["time"]) for e in job.events() if e["reason"] == "node_joined"
                and node in e.get("nodes", []) and stamp(e["time"]) > since]
        if said:
            return said[0]
        if job.view()["world_size"] == 3 and job.new_step(since, size=3):
            return started  # back within its lease: the coordinator never dropped it
        return None

    m = Measured("join", job.wait(joined, what=f"{node} joining the job again"))
    job.measure(m, size=3, restarted=True)
    return m


def patch(up: Up, job: Job, size: int, **change: int) -> Measured:
    """``PATCH /v1/jobs/{id}`` with ``change``; done at a new step of a training
    started after it at world size ``size``."""
    m = Measured("PATCH", time.time())
    response = up.api.patch(f"/v1/jobs/{job.id}", json=change)
    assert response.status_code == 200, response.text
    job.measure(m, size=size, restarted=True)
    return m


def drain(up: Up, job: Job, size: int) -> Measured:
    """``tidal drain`` a node of the job not holding rank 0; done at a new step of a
    training started after it at world size ``size``."""
    m = Measured("drain", time.time())
    up.drain(_not_rank0(job))
    job.measure(m, size=size, restarted=True)
    return m
