"""`make demo`: a tidal cluster on this machine keeps a training job going as nodes come and go.

Starts a :class:`service.up.cluster.LocalCluster` (etcd, the coordinator, three node
agents) in a temporary state directory and submits the char-level LM of
examples/charlm.py through the HTTP API (min 1, max 3 nodes, a checkpoint
every 10 steps). Then:

1. it waits until the job runs at world size 3;
2. SIGKILLs one agent's process group (a machine dying): the job goes on at 2;
3. adds a fourth agent: the job grows back to 3;
4. scales the job down with ``PATCH max_nodes=2``: it goes on at 2;
5. cancels it after a few more steps (its workers checkpoint on the way out).

It then prints a timeline built from rank 0's log (the worker logs the agents
keep under ``STATE/run/<node>/jobs/``): world size over time, how long each
recovery took (event -> first step at the new size), the steps each event cost
(steps done before the restart vs the step resumed from), and the final loss.
charlm's ``--record`` file is written only when a run finishes and holds no
times, so the log, which has a time stamp per step with ``--log-every 1``, is
the source; :class:`Rank0Log` reads it while the job runs, because a restart
overwrites the previous attempt's log. Everything is torn down at the end, on
error and on Ctrl-C too.

Run it with ``python -m examples.demo`` (``--state-dir DIR`` keeps the logs).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import httpx

from service.up import ClusterError, LocalCluster

REPO = Path(__file__).resolve().parents[1]
CHARLM = REPO / "examples" / "charlm.py"
# Small enough for ~15 steps a second on two CPU cores, big enough to learn visibly.
MODEL_ARGS = [
    "--n-layer", "2", "--d-model", "128", "--n-head", "4", "--block-size", "64",
    "--global-batch-size", "24", "--corpus-bytes", "1000000", "--lr", "3e-3",
    "--warmup-steps", "20", "--num-workers", "0", "--device", "cpu",
]
CHECKPOINT_EVERY = 10
STEPS_PER_PHASE = 30  # steps to see at each world size before the next event
WAIT_S = 180.0  # deadline of each wait

_STAMP = r"(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] "
_STEP_RE = re.compile(
    _STAMP + r"rank 0 world_size (?P<ws>\d+) step (?P<step>\d+) loss (?P<loss>\S+)"
)
_START_RE = re.compile(_STAMP + r"start at step (?P<step>\d+) .*?world_size (?P<ws>\d+)")

T = TypeVar("T")


@dataclass(frozen=True)
class StepLine:
    time: float
    world_size: int
    step: int  # the step's index: steps 0..step are done
    loss: float


@dataclass(frozen=True)
class StartLine:
    time: float
    world_size: int
    step: int  # the step resumed from (completed steps in the checkpoint loaded)


@dataclass(frozen=True)
class Event:
    what: str
    time: float
    new_size: int


def _stamp(text: str) -> float:
    # logging's asctime: local time, milliseconds after a comma.
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Rank0Log:
    """Rank 0's step and start lines, collected from the worker logs while the job runs.

    torch elastic writes each attempt's output under ``attempt_<restart count>/``,
    and a restart that tidal does not charge to the budget (a node lost or
    joined) keeps the count, so the next attempt truncates the log of the one
    before. Read only at the end, the logs would hold each runner's last
    attempt. A thread re-reads them every 0.2 s and keeps every line it saw.
    """

    def __init__(self, run_root: Path, job_id: str) -> None:
        self.run_root = run_root
        self.job_id = job_id
        self._steps: dict[tuple[str, int, int], StepLine] = {}
        self._starts: dict[tuple[str, int, int], StartLine] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="rank-0 log", daemon=True)

    def start(self) -> Rank0Log:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.read()

    def _follow(self) -> None:
        while not self._stop.wait(0.2):
            self.read()

    def read(self) -> None:
        for path in self.run_root.glob(f"*/jobs/{self.job_id}/gen-*/logs/**/stderr.log"):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.split("\n")[:-1]:  # complete lines only
                if m := _STEP_RE.match(line):
                    key = (m["ts"], int(m["ws"]), int(m["step"]))
                    step = StepLine(_stamp(m["ts"]), key[1], key[2], float(m["loss"]))
                    with self._lock:
                        self._steps.setdefault(key, step)
                elif m := _START_RE.match(line):
                    key = (m["ts"], int(m["ws"]), int(m["step"]))
                    with self._lock:
                        self._starts.setdefault(key, StartLine(_stamp(m["ts"]), key[1], key[2]))

    def steps(self) -> list[StepLine]:
        with self._lock:
            return sorted(self._steps.values(), key=lambda s: s.time)

    def starts(self) -> list[StartLine]:
        with self._lock:
            return sorted(self._starts.values(), key=lambda s: s.time)


def wait_for(condition: Callable[[], T], *, timeout: float, what: str) -> T:
    """Poll ``condition`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
            if value:
                return value
            last = value
        except httpx.HTTPError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
        time.sleep(0.2)


class Demo:
    """The scenario, step by step, against one cluster."""

    def __init__(self, cluster: LocalCluster, http: httpx.Client) -> None:
        self.cluster = cluster
        self.http = http
        self.started = time.time()
        self.submitted = 0.0
        self.job_id = ""
        self.log: Rank0Log | None = None
        self.events: list[Event] = []

    def say(self, message: str) -> None:
        print(f"[{time.time() - self.started:6.1f}s] {message}", flush=True)

    def job(self) -> dict[str, Any]:
        response = self.http.get(f"/v1/jobs/{self.job_id}")
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def submit(self) -> None:
        checkpoints = self.cluster.checkpoint_root / "charlm"
        spec = {
            "name": "charlm",
            "command": [
                sys.executable, str(CHARLM), "--checkpoint-dir", str(checkpoints),
                "--total-steps", "1000000", "--every-steps", str(CHECKPOINT_EVERY),
                "--log-every", "1", *MODEL_ARGS,
            ],
            "working_dir": ".",
            "checkpoint_dir": "charlm",
            # One thread per worker: three workers share two cores.
            "env": {"OMP_NUM_THREADS": "1"},
            "min_nodes": 1,
            "max_nodes": 3,
            "max_restarts": 3,
            "grace_period_s": 15,
        }
        response = self.http.post("/v1/jobs", json=spec)
        if response.status_code != 201:
            raise RuntimeError(f"submit answered {response.status_code}: {response.text}")
        self.submitted = time.time()
        self.job_id = response.json()["job_id"]
        self.log = Rank0Log(self.cluster.run_root, self.job_id).start()
        self.say(f"submitted job {self.job_id}: examples/charlm.py on 1..3 nodes")

    def steps(self) -> list[StepLine]:
        return self.log.steps() if self.log is not None else []

    def wait_running(self, size: int, *, after: float, steps: int) -> None:
        """Wait until the API says RUNNING at ``size`` and rank 0 did ``steps`` steps at it."""

        def settled() -> bool:
            job = self.job()
            if job["phase"] in ("FAILED", "SUCCEEDED", "CANCELLED"):
                raise RuntimeError(f"job {self.job_id} ended: {job['phase']} ({job['error']})")
            done = [s for s in self.steps() if s.world_size == size and s.time > after]
            return job["phase"] == "RUNNING" and job["world_size"] == size and len(done) >= steps

        wait_for(settled, timeout=WAIT_S, what=f"the job to run {steps} steps at world size {size}")
        job = self.job()
        self.say(f"running at world size {size} on {', '.join(n['node_id'] for n in job['nodes'])}"
                 f" (step {job['last_step']}, last checkpoint at {job['last_checkpoint_step']})")

    def event(self, what: str, new_size: int) -> float:
        now = time.time()
        self.events.append(Event(what, now, new_size))
        self.say(what)
        return now

    def run(self) -> None:
        self.say(f"cluster up at {self.cluster.url} with {', '.join(self.cluster.node_ids)}")
        self.submit()
        self.wait_running(3, after=self.submitted, steps=STEPS_PER_PHASE)

        victim = sorted(n["node_id"] for n in self.job()["nodes"])[-1]
        at = self.event(f"kill {victim} (SIGKILL of its agent's process group)", 2)
        self.cluster.kill_agent(victim)
        self.wait_running(2, after=at, steps=STEPS_PER_PHASE)

        at = time.time()
        node = self.cluster.add_agent()
        self.events.append(Event(f"add {node}", at, 3))
        self.say(f"added {node}")
        self.wait_running(3, after=at, steps=STEPS_PER_PHASE)

        at = self.event("scale down: PATCH max_nodes=2", 2)
        response = self.http.patch(f"/v1/jobs/{self.job_id}", json={"max_nodes": 2})
        response.raise_for_status()
        self.wait_running(2, after=at, steps=STEPS_PER_PHASE)

        self.say("cancelling the job")
        self.http.post(f"/v1/jobs/{self.job_id}/cancel").raise_for_status()
        wait_for(lambda: self.job()["phase"] == "CANCELLED", timeout=WAIT_S,
                 what="the job to be CANCELLED")
        job = self.job()
        self.say(f"the job is CANCELLED; restarts the coordinator counted: {job['restarts']}")

    def history(self) -> list[str]:
        """The coordinator's events for the job, one line each."""
        response = self.http.get(f"/v1/jobs/{self.job_id}/events")
        response.raise_for_status()
        lines = []
        for ev in response.json()["events"]:
            when = datetime.fromisoformat(ev["time"]).timestamp() - self.submitted
            lines.append(f"  {when:7.1f} s  {ev['phase']:<10} {ev['reason']:<15} {ev['message']}")
        return lines


def timeline(demo: Demo) -> list[str]:
    """The report: world size over time, recoveries, steps lost, final loss."""
    if demo.log is None:
        return ["the job was never submitted"]
    demo.log.stop()
    steps, starts = demo.log.steps(), demo.log.starts()
    if not steps:
        return ["no step was logged"]
    t0 = demo.submitted
    out = ["world size over time (from rank 0's log; seconds since the submit):"]
    sizes: list[int] = []
    for i, start in enumerate(starts):
        end = starts[i + 1].time if i + 1 < len(starts) else float("inf")
        mine = [s for s in steps if start.time <= s.time < end]
        if not mine:
            out.append(f"  {start.time - t0:7.1f} s          world size {start.world_size}"
                       f"   resumed at step {start.step}, no step done")
            continue
        out.append(f"  {mine[0].time - t0:7.1f} - {mine[-1].time - t0:6.1f} s  world size "
                   f"{start.world_size}   steps {mine[0].step:>4} - {mine[-1].step:<4}"
                   f" (resumed at {start.step})")
        if not sizes or sizes[-1] != start.world_size:
            sizes.append(start.world_size)
    out.append("world sizes: " + " -> ".join(str(s) for s in sizes))
    out.append("")
    out.append("recoveries (event -> first step at the new size; steps done before the "
               "restart vs the step resumed from):")
    out.append(f"  {'event':<52} {'at':>7} {'size':>4} {'recovery':>9} {'done':>5}"
               f" {'resumed':>7} {'lost':>4}")
    for ev in demo.events:
        first = next((s for s in steps if s.world_size == ev.new_size and s.time > ev.time), None)
        start = next((s for s in starts if s.world_size == ev.new_size and s.time > ev.time), None)
        if first is None or start is None:
            out.append(f"  {ev.what:<52} {ev.time - t0:6.1f}s  never ran at size {ev.new_size}")
            continue
        running = [s for s in starts if s.time <= ev.time]
        since = running[-1].time if running else t0
        before = [s.step for s in steps if since <= s.time < start.time]
        done = max(before) + 1 if before else start.step
        out.append(f"  {ev.what:<52} {ev.time - t0:6.1f}s {ev.new_size:>4} "
                   f"{first.time - ev.time:8.1f}s {done:>5} {start.step:>7} "
                   f"{max(0, done - start.step):>4}")
    last = steps[-1]
    out.append("")
    out.append(f"first loss {steps[0].loss:.4f} (step {steps[0].step}); final loss {last.loss:.4f} "
               f"(step {last.step}, world size {last.world_size}, rank 0)")
    return out


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="keep the cluster's state (logs) here; default: a temporary "
                        "directory, removed unless the demo fails")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # tear down on SIGTERM as on Ctrl-C
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="tidal-demo-"))
    began = time.monotonic()
    cluster = LocalCluster(state_dir=state_dir, agents=3, workdir_root=REPO, stop_grace_s=20)
    demo: Demo | None = None
    code = 1
    try:
        with cluster, cluster.client(timeout=10) as http:
            demo = Demo(cluster, http)
            try:
                demo.run()
                history = demo.history()
                code = 0
            except (TimeoutError, RuntimeError, ClusterError, httpx.HTTPError) as exc:
                demo.say(f"demo failed: {exc}")
                with contextlib.suppress(httpx.HTTPError):
                    print("\n".join(demo.history()))
                _print_tails(cluster)
                history = []
            demo.say("stopping the cluster")
        if demo.job_id:
            print()
            print("\n".join(timeline(demo)))
            if history:
                print()
                print("the coordinator's events for the job:")
                print("\n".join(history))
    except ClusterError as exc:
        print(f"the cluster did not start: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted: everything was stopped", file=sys.stderr)
        code = 130
    print(f"\ndemo took {time.monotonic() - began:.0f} s; nothing it started is running",
          flush=True)
    if args.state_dir is None and code == 0:
        shutil.rmtree(state_dir, ignore_errors=True)
    elif code != 0:
        print(f"logs kept in {state_dir}", file=sys.stderr)
    return code


def _print_tails(cluster: LocalCluster, lines: int = 25) -> None:
    for path in sorted(cluster.logs_dir.glob("*.log")):
        if path.name == "etcd.log":
            continue
        text = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- last lines of {path} ---\n" + "\n".join(text))


if __name__ == "__main__":
    sys.exit(main())
