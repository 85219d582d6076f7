"""Benchmark: goodput under churn, one node SIGKILLed and a fresh one added every 30 s.

Run with
``.venv/bin/python -m pytest tests/bench/bench_churn.py -m bench -s``
(``BENCH_CHURN_SECONDS`` the measured window per variant, 600 by default as
in issue 15; ``BENCH_CHURN_PERIOD`` the churn period, 30 s;
``BENCH_CHURN_VARIANTS``, a comma-separated choice of ``jit``, ``nojit``,
``live``, ``torchft5`` and ``torchft3``, ``jit,nojit`` by default).

One job of ``examples/mlp.py`` (the checkpoints library, DDP over gloo, a
periodic checkpoint every 100 steps, one step paced at 0.1 s) on three
`tidal agent` processes on loopback, min 1 and max 3 nodes; the assignments
are written straight into etcd (the coordinator's part left out, as in
bench_recovery). Beside it, in the same run and on the same machine, the
same script under plain ``torchrun --standalone`` at world size 3 is never
disturbed: the reference. Once both train, the measured window starts. A
quarter into each period the oldest node is SIGKILLed with every process of
it; half a period later a fresh agent is given the job (a join: a healthy
restart, or the live path). The fresh agent was started a period earlier (a
spare node that is up by then, as in a pool), and is given the job only
once its warm runner is ready, as a coordinator would once it registered
(else the survivors' round would wait for a node still importing torch);
on a machine too loaded for that the join comes later, at the latest with
the next kill. The last join is at least a quarter period before the window
ends, so the job is training again at its end.

Variants: ``jit``, the just-in-time save on; ``nojit``, off with
``TIDAL_JIT_SAVE=0`` in the job's environment (both: every kill and join
restarts the survivors' workers); ``live``, the save on and the script run
with ``--live-resize``: the fresh node's join is taken on the live path (the
survivors re-form their process group without restarting) and, since issue
25, so is the kill: the survivors' runners tell their workers a member is
lost, the workers discard the step in flight and re-form the group in place
(the restart path only as a fallback, which the report would show).

``torchft5`` and ``torchft3``: the same model, data, pace and churn under
torchft instead of tidal (tests/bench/churn_torchft.py: three replica groups
of one process, ``Manager`` + its ``DistributedDataParallel`` over
``ProcessGroupGloo``, min 1 replica, its ``LighthouseServer`` on 127.0.0.1
with a heartbeat timeout of 5 s, torchft's default, or 3 s); a kill SIGKILLs
the oldest replica, a join lets a spare replica (started a period early and
ready, as the spare agent) join the quorum. Beside it, the same torchrun
reference. torchft is no tidal dependency: ``make torchft-site`` installs it
into build/torchft-site (``BENCH_TORCHFT_SITE`` another folder); without it
these variants are skipped with a note.

Reported, per variant:

* **goodput**: steps the churned job advanced (torchft: committed) over the
  window / steps the reference advanced over the same window;
* **undisturbed pace**: the same ratio over the 15 s before the window, no
  churn yet: what the system costs a step in steady state (part of goodput,
  apart from the churn's own cost);
* **at full size**: the share of the window's new steps taken by all three
  (tidal: at world size 3, the global batch is 32 at any size; torchft: with 3
  participants, each replica adds its own 11 samples, so a step of 2 trains on
  fewer samples);
* **each kill**: the path the survivors took (``in place``: they kept their
  processes; ``restart``: their workers were restarted), the steps lost (the
  last step completed before the kill minus the step the survivors went on
  from; torchft never goes back, its failed steps are not committed), and the
  training pause (the longest gap between two consecutive new steps of the
  job, from the last step before the kill to the third step after it);
* **where each kill's seconds go** (medians over kills, from the runners' and
  workers' logs). Restart path: *notice* (kill to the survivors' runner
  stopping its broken group), *save* (the runner's wait for just-in-time
  saves), *rendezvous* (until the last survivor's new round), *start-up*
  (until the first step after the kill), *redo* (steps lost x the mean step
  time). In place: *notice* (kill to the first survivor's runner resizing in
  place), *runner* (the runners' own figure, notice to every worker resized,
  the worst survivor), *worker* (the workers' own figure for the recovery,
  failed collective to on_resize done, the worst), *first step* (the last
  worker recovered to the job's next new step). torchft: *quorum* (kill to the
  first survivor reconfiguring for a new quorum), *first step* (to the job's
  next new step), *failed commits* (steps the survivors did not commit);
* **each join**: the path the survivors' runners took (live, or a restart;
  torchft: a new quorum), the training pause (the longest gap between two
  consecutive new steps of the job from the last step before the fresh node
  was given the job to the third step at the full size), and the runner's own
  figure for a live resize (from seeing the joiner to every worker resized).

No assertion is made on time or goodput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment
from tests.bench.bench_recovery import MARKER, _no_leftovers, _stamp
from tests.support.agents import AgentCluster, assign, unassign
from tests.support.processes import ProcessGroupRegistry
from tests.support.runners import runner_pid

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.py"
TORCHFT_SITE = Path(os.environ.get("BENCH_TORCHFT_SITE", ROOT / "build" / "torchft-site"))
WINDOW_S = float(os.environ.get("BENCH_CHURN_SECONDS", "600"))
PERIOD_S = float(os.environ.get("BENCH_CHURN_PERIOD", "30"))
STEP_SECONDS = 0.1
EVERY_STEPS = 100
START_DEADLINE_S = 180.0
PACE_S = 15.0  # undisturbed, before the window: each job's own pace against the reference's
ARGS = ["--total-steps", str(10**7), "--every-steps", str(EVERY_STEPS),
        "--step-seconds", str(STEP_SECONDS), "--dataset-size", "4096"]
_STEP = re.compile(r"rank \d+ world_size (\d+) step (\d+) loss")
_START = re.compile(r"start at step (\d+) ")
_LIVE_DONE = re.compile(r"resized into round \d+ live in ([\d.]+) s")
_RESTARTED = ("restarting the group", "did not complete")
# The in-place recovery of a kill (issue 25): the runner's notice and figure, the worker's.
_IN_PLACE_RUNNER = "(in place: the survivors keep their processes)"
_IN_PLACE_WORKER = re.compile(r"recovered in place at step (\d+): .* in ([\d.]+) s ")
_KILL_RESTARTED = ("did not complete", "restarting without them", "stopping the broken worker")
# A live join: the runners' notice, the survivors' own figures (checkpoints.live.resizing).
_TOLD = re.compile(r"told the workers round (\d+) \(world size 3\)")
_RESIZED = re.compile(r"resized live at step \d+: .* in ([\d.]+) s \(notice and drain ([\d.]+) s, "
                      r"init_process_group ([\d.]+) s, own groups ([\d.]+) s, "
                      r"state sync ([\d.]+) s, on_resize ([\d.]+) s\)")
# torchft's replicas (tests/bench/churn_torchft.py) and its manager's own lines.
_TFT_STEP = re.compile(r"replica (\d+) step (\d+) committed (True|False) participants (\d+)")
_TFT_QUORUM = "reconfiguring for quorum_id="
PAUSE_STEPS = 3  # a pause ends at the third new step (a join's: at the full size)


@dataclasses.dataclass
class Line:
    time: float
    text: str
    node: str


def read_lines(paths: list[tuple[str, Path]]) -> list[Line]:
    """Time-stamped lines of these logs, oldest first."""
    lines = []
    for node, path in paths:
        if not path.exists():
            continue
        for text in path.read_text(errors="replace").splitlines():
            stamp = _stamp(text)
            if stamp is not None:
                lines.append(Line(stamp, text, node))
    return sorted(lines, key=lambda line: line.time)


def sized_steps(lines: list[Line]) -> list[tuple[float, int, int]]:
    """(time, completed steps, world size) of every step line (torchft: committed steps,
    participants, of every committed step)."""
    out = []
    for ln in lines:
        if m := _STEP.search(ln.text):
            out.append((ln.time, int(m.group(2)) + 1, int(m.group(1))))
        elif (m := _TFT_STEP.search(ln.text)) and m.group(3) == "True":
            out.append((ln.time, int(m.group(2)), int(m.group(4))))
    return out


def steps_of(lines: list[Line]) -> list[tuple[float, int]]:
    """(time, completed steps) of every step line."""
    return [(t, s) for t, s, _ in sized_steps(lines)]


def frontier(steps: list[tuple[float, int]], at: float) -> int:
    """The most steps any line at or before ``at`` says were complete (0 if none)."""
    return max((s for t, s in steps if t <= at), default=0)


def new_steps(lines: list[Line]) -> list[tuple[float, int, int]]:
    """The job's new steps (the first line of each step number), in time order."""
    firsts: list[tuple[float, int, int]] = []
    top = 0
    for t, step, size in sized_steps(lines):
        if step > top:
            firsts.append((t, step, size))
            top = step
    return firsts


def longest_gap(firsts: list[tuple[float, int, int]], at: float, until: float,
                size: int | None = None) -> float | None:
    """The longest gap between two consecutive new steps from the last one at or before
    ``at`` to the :data:`PAUSE_STEPS`-th after it (of world size ``size``, if given)."""
    before = [s for s in firsts if s[0] <= at]
    after = [s for s in firsts if at < s[0] < until and (size is None or s[2] == size)]
    after = after[:PAUSE_STEPS]
    if not before or len(after) < PAUSE_STEPS:
        return None
    window = [s for s in firsts if before[-1][0] <= s[0] <= after[-1][0]]
    return max(b[0] - a[0] for a, b in itertools.pairwise(window))


@dataclasses.dataclass
class Kill:
    at: float
    victim: str
    path: str | None = None  # "in place" or "restart", from the survivors' logs
    lost: int | None = None
    pause: float | None = None  # the longest gap between new steps around the kill
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    joined_at: float | None = None  # when the fresh node was given the job
    join_path: str | None = None  # "live" or "restart", from the survivors' runners
    join_pause: float | None = None  # the longest gap between new steps around the join
    live_s: float | None = None  # the runners' own figure for the live resize
    join_parts: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Variant:
    name: str
    goodput: float | None = None
    kept: int = 0
    reference: int = 0
    pace: float | None = None  # undisturbed steps / the reference's, before the window
    full: float | None = None  # the window's new steps taken by all 3 (torchft: participants)
    kills: list[Kill] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def analyse_kill(kill: Kill, worker: list[Line], runner: list[Line], survivors: set[str],
                 step_s: float, until: float) -> None:
    """The path, steps lost and where the seconds went, for one kill of the tidal job
    (nothing: no recovery before ``until``, the join, the next kill or the window's end)."""
    kill.pause = longest_gap(new_steps(worker), kill.at, until)
    texts = [ln.text for ln in runner if kill.at < ln.time < until and ln.node in survivors]
    in_place = any(_IN_PLACE_RUNNER in t for t in texts)
    if in_place and not any(r in t for t in texts for r in _KILL_RESTARTED):
        analyse_in_place(kill, worker, runner, survivors, until)
    else:
        analyse_restart(kill, worker, runner, survivors, step_s, until)


def analyse_in_place(kill: Kill, worker: list[Line], runner: list[Line], survivors: set[str],
                     until: float) -> None:
    """A kill the survivors recovered from in place: their workers kept their processes."""
    ours = [ln for ln in worker if kill.at < ln.time < until and ln.node in survivors]
    recovered = [(ln, m) for ln in ours if (m := _IN_PLACE_WORKER.search(ln.text))]
    if not recovered:
        return
    kill.path = "in place"
    resumed = min(int(m.group(1)) for _, m in recovered)
    done = steps_of([ln for ln in worker if ln.time < recovered[0][0].time])
    kill.lost = max(s for _, s in done) - resumed if done else None
    notices = [ln.time for ln in runner if kill.at < ln.time < until
               and ln.node in survivors and _IN_PLACE_RUNNER in ln.text]
    figures = [float(m.group(1)) for ln in runner if kill.at < ln.time < until
               and ln.node in survivors and (m := _LIVE_DONE.search(ln.text))]
    last = max(ln.time for ln, _ in recovered)
    first_step = next((t for t, _, _ in new_steps(worker) if t > last), None)
    kill.parts = {"notice": min(notices) - kill.at,
                  "runner": max(figures, default=float("nan")),
                  "worker": max(float(m.group(2)) for _, m in recovered)}
    if first_step is not None:
        kill.parts["first step"] = first_step - last


def analyse_restart(kill: Kill, worker: list[Line], runner: list[Line], survivors: set[str],
                    step_s: float, until: float) -> None:
    """A kill that restarted the survivors' workers: from their new start."""
    after = [ln for ln in worker if kill.at < ln.time < until and ln.node in survivors]
    start = next((ln for ln in after if _START.search(ln.text)), None)
    if start is None:
        return
    kill.path = "restart"
    before = [s for t, s in steps_of([ln for ln in worker if ln.time < start.time])]
    resumed = int(_START.search(start.text).group(1))  # type: ignore[union-attr]
    kill.lost = max(before) - resumed if before else None
    stops = [ln for ln in runner if ln.time > kill.at and ln.node in survivors
             and "stopping the broken worker group" in ln.text]
    waits = [float(m.group(1)) for ln in runner if ln.time > kill.at and ln.time < start.time
             and (m := re.search(r"waited ([\d.]+) s for just-in-time saves", ln.text))]
    rounds = [ln.time for ln in runner if ln.time > kill.at and ln.time < start.time + 1
              and "group_world_size=" in ln.text]
    first_step = next((t for t, _ in steps_of(after)), None)
    if not stops or first_step is None:
        return
    notice = min(ln.time for ln in stops)
    save = max(waits, default=0.0)
    rendezvous = max(rounds) if rounds else start.time
    kill.parts = {
        "notice": notice - kill.at,
        "save": save,
        "rendezvous": max(0.0, rendezvous - notice - save),
        "start-up": max(0.0, first_step - rendezvous),
        "redo": (kill.lost or 0) * step_s,
    }


def analyse_join(kill: Kill, worker: list[Line], runner: list[Line], until: float,
                 full: int) -> None:
    """The path and the training pause of the fresh node's join after ``kill``."""
    if kill.joined_at is None:
        return
    at = kill.joined_at
    texts = [ln.text for ln in runner if at < ln.time < until]
    done = [float(m.group(1)) for t in texts if (m := _LIVE_DONE.search(t))]
    if any(any(r in t for r in _RESTARTED) for t in texts):
        kill.join_path = "restart"
    elif done:
        kill.join_path, kill.live_s = "live", max(done)
    kill.join_pause = longest_gap(new_steps(worker), at, until, size=full)
    if kill.join_path == "live":
        join_parts(kill, worker, runner, until, full)


def join_parts(kill: Kill, worker: list[Line], runner: list[Line], until: float,
               full: int) -> None:
    """Where a live join's seconds went: *told* (the fresh node given the job -> the last
    survivor's runner told its workers the round), *trained on* (-> the survivors' last
    step in the old group: they train on until the joiner waits in the new group), then
    the survivors' own figures (the worst survivor): *stop* (their notice and drain),
    *re-form* (init_process_group and the checkpointer's own groups), *sync* (the state
    sent to the joiner), *on_resize* (DDP and the sampler rebuilt), and *first step* (->
    the job's first new step at full size)."""
    at = kill.joined_at
    assert at is not None
    told = [ln.time for ln in runner if at < ln.time < until and _TOLD.search(ln.text)]
    resized = [(ln.time, m) for ln in worker if at < ln.time < until
               and (m := _RESIZED.search(ln.text))]
    if not told or not resized:
        return
    last = max(t for t, _ in resized)
    stopped = last - max(float(m.group(1)) for _, m in resized)
    before = [t for t, _, _ in new_steps([ln for ln in worker if ln.time <= stopped])]
    first = next((t for t, _, size in new_steps(worker) if t > last and size == full), None)
    kill.join_parts = {
        "told": max(told) - at,
        "trained on": (before[-1] if before else stopped) - max(told),
        **{name: max(float(m.group(i)) for _, m in resized)
           for i, name in ((2, "stop"), (5, "sync"), (6, "on_resize"))},
        "re-form": max(float(m.group(3)) + float(m.group(4)) for _, m in resized),
    }
    if first is not None:
        kill.join_parts["first step"] = first - last


def analyse_torchft(kill: Kill, lines: list[Line], survivors: set[str], until: float,
                    full: int) -> None:
    """A kill and the join after it in the torchft job: its survivors keep their
    processes by design; failed commits are steps not taken, none is undone."""
    firsts = new_steps(lines)
    end = kill.joined_at or until
    kill.pause = longest_gap(firsts, kill.at, end)
    ours = [ln for ln in lines if kill.at < ln.time < end and ln.node in survivors]
    quorum = next((ln.time for ln in ours if _TFT_QUORUM in ln.text), None)
    if quorum is not None:
        kill.path, kill.lost = "in place", 0
        first_step = next((t for t, _, _ in firsts if t > quorum), None)
        failed = sum(1 for ln in ours if (m := _TFT_STEP.search(ln.text))
                     and m.group(3) == "False")
        kill.parts = {"quorum": quorum - kill.at, "failed commits": float(failed)}
        if first_step is not None:
            kill.parts["first step"] = first_step - quorum
    if kill.joined_at is not None:
        joined = [ln for ln in lines if kill.joined_at < ln.time < until]
        if any(_TFT_QUORUM in ln.text for ln in joined):
            kill.join_path = "live"
        kill.join_pause = longest_gap(firsts, kill.joined_at, until, size=full)


def spawn_reference(procs: ProcessGroupRegistry, workdir: Path) -> Path:
    """The undisturbed torchrun job at world size 3; returns its log."""
    ref_log = workdir / "reference.log"
    procs.spawn(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
         str(MLP), "--checkpoint-dir", str(workdir / "ref-ckpt"), *ARGS],
        log_path=ref_log, env=dict(os.environ, OMP_NUM_THREADS="1", TIDAL_JIT_SAVE="0"),
    )
    return ref_log


@dataclasses.dataclass
class Churn:
    """How one system is churned: the bench's clock calls these."""
    kill_oldest: Callable[[], str]  # SIGKILL the oldest member; returns its name
    spare_ready: Callable[[], bool]  # the spare has imported torch and can join
    join_spare: Callable[[], None]  # give the spare the job, start the next spare


def churn(out: Variant, c: Churn, t0: float) -> float:
    """A kill a quarter into each period, a join half a period later, until the window
    ends; returns the window's end."""
    kill_at = t0 + PERIOD_S / 4
    while kill_at < t0 + WINDOW_S - 3 * PERIOD_S / 4:
        time.sleep(max(0.0, kill_at - time.time()))
        at = time.time()
        out.kills.append(Kill(at=at, victim=c.kill_oldest()))
        time.sleep(max(0.0, kill_at + PERIOD_S / 2 - time.time()))
        ready_by = kill_at + PERIOD_S
        while not c.spare_ready() and time.time() < ready_by:
            time.sleep(0.2)
        c.join_spare()
        out.kills[-1].joined_at = time.time()
        kill_at += PERIOD_S
    time.sleep(max(0.0, t0 + WINDOW_S - time.time()))
    return time.time()


def wait_training(out: Variant, ready: Callable[[], bool]) -> bool:
    """Wait until ``ready`` (both jobs train, the spare is up), bounded."""
    give_up = time.monotonic() + START_DEADLINE_S
    while not ready():
        if time.monotonic() > give_up:
            out.notes.append("the jobs never both trained")
            return False
        time.sleep(0.5)
    return True


def measure_pace(out: Variant, steps: Callable[[], list[tuple[float, int]]],
                 ref_log: Path) -> float:
    """:data:`PACE_S` undisturbed: the job's steps over the reference's (its steady cost,
    apart from the churn's). Returns when the window may start."""
    start = time.time()
    time.sleep(PACE_S)
    end = time.time()
    ref = steps_of(read_lines([("ref", ref_log)]))
    mine = steps()
    done = frontier(ref, end) - frontier(ref, start)
    out.pace = (frontier(mine, end) - frontier(mine, start)) / done if done else None
    return end


def count_goodput(out: Variant, lines: list[Line], ref_log: Path, t0: float,
                  t_end: float) -> float:
    """Goodput over [t0, t_end]; returns the reference's median step time."""
    ref = steps_of(read_lines([("ref", ref_log)]))
    steps = new_steps(lines)
    out.kept = frontier([(t, s) for t, s, _ in steps], t_end) - frontier(
        [(t, s) for t, s, _ in steps], t0)
    out.reference = frontier(ref, t_end) - frontier(ref, t0)
    out.goodput = out.kept / out.reference if out.reference else None
    sizes = [size for t, _, size in steps if t0 < t <= t_end]
    out.full = sum(size == 3 for size in sizes) / len(sizes) if sizes else None
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(ref) if b[1] == a[1] + 1]
    return statistics.median(intervals) if intervals else STEP_SECONDS


def _warm(workdir: Path, node: str) -> bool:
    """Whether the node's warm runner has imported torch and its zygote is up."""
    logs = [p.read_text(errors="replace") for p in (workdir / node / "warm").glob("*.log")]
    return any("zygote ready" in t and "ready for a job" in t for t in logs)


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (its children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(agent_pid: int) -> None:
    """SIGKILL every process of a node at once, as a machine that dies: the agent and
    everything below it (its runners, their zygotes and workers, which run in sessions
    of their own). Killing the agent's process group alone leaves the others to die
    one after the other by their parent-death signals: 0.2-0.5 s on a loaded machine
    before the last of them (the runner, whose liveness sockets tell the survivors)
    was gone, a delay a dying machine does not have."""
    for pid in [agent_pid, *descendants(agent_pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


_RESIZING = "resizing the group live"
_RESOLVED = ("resized into round", "did not complete", "restarting", "stopping on")
STUCK_S = 10.0  # a live resize that has neither completed nor fallen back by then


class RunnerWatchdog:
    """Asks a runner stuck in a live resize for its threads' stacks.

    A runner that logged "resizing the group live" and, :data:`STUCK_S` later,
    neither that its workers resized nor that it fell back is sent SIGUSR1: its
    faulthandler (agent.runner's main) writes every thread's stack into its log.
    Once per resize; what it did goes into the variant's notes.
    """

    def __init__(self, workdir: Path, out: Variant) -> None:
        self._workdir, self._out = workdir, out
        self._dumped: set[tuple[str, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="runner-watchdog", daemon=True)

    def __enter__(self) -> RunnerWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            for path in self._workdir.glob("n*/jobs/*/gen-*/runner.log"):
                self._check(path.parts[-5], path)

    def _check(self, node: str, path: Path) -> None:
        lines = [(t, ln) for ln in path.read_text(errors="replace").splitlines()
                 if (t := _stamp(ln)) is not None]
        started = [t for t, ln in lines if _RESIZING in ln]
        if not started or (node, started[-1]) in self._dumped:
            return
        if any(t > started[-1] and any(r in ln for r in _RESOLVED) for t, ln in lines):
            return
        if time.time() - started[-1] < STUCK_S:
            return
        pid = runner_pid(path)  # only a runner of ours, still running
        if pid is None:
            return
        self._dumped.add((node, started[-1]))
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            return
        self._out.notes.append(
            f"the runner of {node} (pid {pid}) was stuck {STUCK_S:g} s in a live resize "
            f"begun at {time.strftime('%H:%M:%S', time.localtime(started[-1]))}: its stacks "
            f"are in {path}")


def run_variant(name: str, jit: bool, live_resize: bool, workdir: Path, etcd: EtcdServer,
                root: str) -> Variant:
    out = Variant(name)
    workdir.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroupRegistry()
    client = create_client(EtcdConfig(endpoints=[etcd.endpoint], root=root, timeout_s=10))
    cluster = AgentCluster(etcd_endpoint=etcd.endpoint, etcd_root=root, workdir=workdir,
                           procs=procs)
    # One thread per worker, as the reference gets: three workers with torch's
    # default threads each oversubscribe a small machine and step slower.
    env = {"OMP_NUM_THREADS": "1", **({} if jit else {"TIDAL_JIT_SAVE": "0"})}
    job = Assignment(
        job_id="churn",
        command=[sys.executable, str(MLP), "--checkpoint-dir", str(workdir / "ckpt"), *ARGS,
                 *(["--live-resize"] if live_resize else [])],
        cwd=str(workdir), min_nodes=1, max_nodes=3, max_restarts=3, grace_period_s=10, env=env,
    )
    try:
        ref_log = spawn_reference(procs, workdir)
        live = ["n0", "n1", "n2"]
        for node in live:
            cluster.start_agent(node)
        for node in live:
            assign(client, node, job)
        spares = (f"n{i}" for i in itertools.count(len(live)))
        spare = next(spares)
        cluster.start_agent(spare)

        def worker_logs() -> list[tuple[str, Path]]:
            return [(n, p) for n in cluster.agents for p in sorted((workdir / n).rglob("*.log"))
                    if p.name != "runner.log" and "warm" not in p.parts]

        def runner_logs() -> list[tuple[str, Path]]:
            return [(n, p) for n in cluster.agents for p in (workdir / n).rglob("runner*.log")]

        def training() -> bool:
            sizes = {s for _, _, s in sized_steps(read_lines(worker_logs())[-30:])}
            ref_going = bool(steps_of(read_lines([("ref", ref_log)])[-5:]))
            return 3 in sizes and ref_going and _warm(workdir, spare)

        def kill_oldest() -> str:
            victim = live.pop(0)
            kill_node(cluster.agents[victim].pid)
            cluster.kill_agent(victim)
            unassign(client, victim, job.job_id)
            return victim

        def join_spare() -> None:
            nonlocal spare
            assign(client, spare, job)
            live.append(spare)
            spare = next(spares)
            cluster.start_agent(spare)

        if not wait_training(out, training):
            return out
        t0 = measure_pace(out, lambda: steps_of(read_lines(worker_logs())), ref_log)
        with RunnerWatchdog(workdir, out):
            t_end = churn(out, Churn(kill_oldest, lambda: _warm(workdir, spare), join_spare),
                          t0)
        worker = read_lines(worker_logs())
        runner = read_lines(runner_logs())
        step_s = count_goodput(out, worker, ref_log, t0, t_end)
        for index, kill in enumerate(out.kills):
            survivors = set(cluster.agents) - {k.victim for k in out.kills[: index + 1]}
            until = out.kills[index + 1].at if index + 1 < len(out.kills) else t_end
            analyse_kill(kill, worker, runner, survivors, step_s, kill.joined_at or until)
            analyse_join(kill, worker, runner, until, full=3)
    finally:
        for node in list(cluster.agents):
            cluster.kill_agent(node)
        procs.stop_all()
        client.close()
    return out


def run_torchft(name: str, heartbeat_ms: int, workdir: Path) -> Variant:
    """The same churn on the same model under torchft (tests/bench/churn_torchft.py)."""
    out = Variant(name)
    workdir.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroupRegistry()
    module = [sys.executable, "-m", "tests.bench.churn_torchft", "--site", str(TORCHFT_SITE)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    replicas: dict[str, subprocess.Popen[bytes]] = {}
    try:
        ref_log = spawn_reference(procs, workdir)
        address_file = workdir / "lighthouse.address"
        procs.spawn([*module, "lighthouse", "--address-file", str(address_file),
                     "--heartbeat-timeout-ms", str(heartbeat_ms)],
                    log_path=workdir / "lighthouse.log", env=env, cwd=ROOT)
        give_up = time.monotonic() + 60
        while not address_file.exists():
            if time.monotonic() > give_up:
                out.notes.append("the lighthouse never said its address")
                return out
            time.sleep(0.1)
        address = address_file.read_text().strip()

        def start(index: int) -> str:
            replica = f"r{index}"
            replicas[replica] = procs.spawn(
                [*module, "replica", "--lighthouse", address, "--replica", str(index),
                 "--ready-file", str(workdir / f"{replica}.ready"),
                 "--go-file", str(workdir / f"{replica}.go"),
                 "--step-seconds", str(STEP_SECONDS)],
                log_path=workdir / f"{replica}.log", env=env, cwd=ROOT)
            return replica

        live = [start(i) for i in range(3)]
        for replica in live:
            (workdir / f"{replica}.go").touch()
        spares = itertools.count(len(live))
        spare = start(next(spares))

        def logs() -> list[tuple[str, Path]]:
            return [(r, workdir / f"{r}.log") for r in replicas]

        def training() -> bool:
            sizes = {s for _, _, s in sized_steps(read_lines(logs())[-60:])}
            ref_going = bool(steps_of(read_lines([("ref", ref_log)])[-5:]))
            return 3 in sizes and ref_going and (workdir / f"{spare}.ready").exists()

        def kill_oldest() -> str:
            victim = live.pop(0)
            procs.kill_group(replicas[victim])
            return victim

        def join_spare() -> None:
            nonlocal spare
            (workdir / f"{spare}.go").touch()
            live.append(spare)
            spare = start(next(spares))

        if not wait_training(out, training):
            return out
        t0 = measure_pace(out, lambda: steps_of(read_lines(logs())), ref_log)
        t_end = churn(out, Churn(kill_oldest, lambda: (workdir / f"{spare}.ready").exists(),
                                 join_spare), t0)
        lines = read_lines(logs())
        count_goodput(out, lines, ref_log, t0, t_end)
        for index, kill in enumerate(out.kills):
            survivors = set(replicas) - {k.victim for k in out.kills[: index + 1]}
            until = out.kills[index + 1].at if index + 1 < len(out.kills) else t_end
            analyse_torchft(kill, lines, survivors, until, full=3)
    finally:
        procs.stop_all()
    return out


def _med_worst(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"


def report(variants: list[Variant], load: tuple[float, float]) -> str:
    lines = [
        f"window {WINDOW_S:g} s per variant, a kill and a fresh node every {PERIOD_S:g} s, "
        f"every_steps={EVERY_STEPS}, step paced at {STEP_SECONDS} s; {os.cpu_count()} cores, "
        f"1-min load {load[0]:.1f} at the start, {load[1]:.1f} at the end",
        "",
        "| variant | goodput | steps kept / reference | at full size | undisturbed pace | kills "
        "| kills in place / restarted "
        "| steps lost per kill (median / worst) | kill pause median / worst (s) "
        "| joins live / all | join pause median / worst (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        lost = [k.lost for k in v.kills if k.lost is not None]
        cells = [
            v.name,
            f"{100 * v.goodput:.1f}%" if v.goodput is not None else "-",
            f"{v.kept} / {v.reference}",
            f"{100 * v.full:.0f}%" if v.full is not None else "-",
            f"{100 * v.pace:.1f}%" if v.pace is not None else "-",
            str(len(v.kills)),
            f"{sum(k.path == 'in place' for k in v.kills)} / "
            f"{sum(k.path == 'restart' for k in v.kills)}",
            f"{statistics.median(lost):g} / {max(lost)}" if lost else "-",
            _med_worst([k.pause for k in v.kills if k.pause is not None]),
            f"{sum(k.join_path == 'live' for k in v.kills)} / "
            f"{sum(k.joined_at is not None for k in v.kills)}",
            _med_worst([k.join_pause for k in v.kills if k.join_pause is not None]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| variant | kill path | kills | where a kill's seconds go (medians, s) |",
              "|---|---|---|---|"]
    for v in variants:
        for path in ("in place", "restart"):
            parts = [k.parts for k in v.kills if k.path == path and k.parts]
            if not parts:
                continue
            keys = list(dict.fromkeys(key for p in parts for key in p))
            medians = ", ".join(
                f"{key} {statistics.median(p[key] for p in parts if key in p):.2f}"
                for key in keys)
            lines.append(f"| {v.name} | {path} | {len(parts)} | {medians} |")
    for v in variants:
        parts = [k.join_parts for k in v.kills if k.join_parts]
        if parts:
            keys = list(dict.fromkeys(key for p in parts for key in p))
            lines.append(f"| {v.name} | live join | {len(parts)} | " + ", ".join(
                f"{key} {statistics.median(p[key] for p in parts if key in p):.2f}"
                for key in keys) + " |")
    lines.append("")
    for v in variants:
        lines += [f"{v.name}: kill {i + 1} at +{k.at - v.kills[0].at:.0f} s: "
                  + (f"path {k.path}, lost {k.lost}, pause "
                     + ("-" if k.pause is None else f"{k.pause:.2f} s") + "; "
                     if k.path else "no recovery seen before the join; ")
                  + ", ".join(f"{n} {s:.2f}" for n, s in k.parts.items())
                  + f"; join +{(k.joined_at or k.at) - k.at:.1f} s after the kill: "
                  + f"path {k.join_path or '-'}, pause "
                  + ("-" if k.join_pause is None else f"{k.join_pause:.2f} s")
                  + ("" if k.live_s is None else f", runner's live resize {k.live_s:.2f} s")
                  + "".join(f", {n} {s:.2f}" for n, s in k.join_parts.items())
                  for i, k in enumerate(v.kills)]
        lines += [f"{v.name}: {note}" for note in v.notes]
    return "\n".join(lines)


@pytest.mark.bench
@pytest.mark.timeout(3 * 3600)
def test_bench_goodput_under_churn(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, marker)
    monkeypatch.setenv("LOGLEVEL", "INFO")  # torch elastic logs its rounds: the breakdown
    wanted = os.environ.get("BENCH_CHURN_VARIANTS", "jit,nojit").split(",")
    load_start = os.getloadavg()[0]
    variants = []
    # name -> (label, just-in-time save, --live-resize)
    known = {"jit": ("JIT save on", True, False), "nojit": ("JIT save off", False, False),
             "live": ("JIT save on + live (joins live, kills in place)", True, True)}
    # name -> (label, the lighthouse's heartbeat timeout in ms)
    torchft = {"torchft5": ("torchft, heartbeat timeout 5 s", 5000),
               "torchft3": ("torchft, heartbeat timeout 3 s", 3000)}
    skipped = []
    for name in wanted:
        with _no_leftovers(ProcessGroupRegistry(), marker):
            if name in known:
                label, jit, live_resize = known[name]
                variants.append(run_variant(
                    label, jit, live_resize, tmp_path / name, etcd_server, f"{etcd_root}-{name}"
                ))
            elif name in torchft and not (TORCHFT_SITE / "torchft").is_dir():
                skipped.append(f"{name} skipped: torchft is not installed in {TORCHFT_SITE} "
                               "(make torchft-site)")
                continue
            elif name in torchft:
                label, heartbeat_ms = torchft[name]
                variants.append(run_torchft(label, heartbeat_ms, tmp_path / name))
            else:
                skipped.append(f"{name} skipped: no such variant")
                continue
        print(f"\n{variants[-1]}")
    print("\n" + report(variants, (load_start, os.getloadavg()[0])))
    print("\n".join(skipped))
    if not variants:
        pytest.skip("; ".join(skipped))
