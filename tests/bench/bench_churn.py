"""Benchmark: goodput under churn, one node SIGKILLed and a fresh one added every 30 s.

Run with
``.venv/bin/python -m pytest tests/bench/bench_churn.py -m bench -s``
(``BENCH_CHURN_SECONDS`` the measured window per variant, 600 by default as
in issue 15; ``BENCH_CHURN_PERIOD`` the churn period, 30 s;
``BENCH_CHURN_VARIANTS``, a comma-separated choice of ``jit``, ``nojit`` and
``live``, ``jit,nojit`` by default).

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
``TIDAL_JIT_SAVE=0`` in the job's environment; ``live``, issue 16's "both
changes in": the save on and the script run with ``--live-resize``, so that
the fresh node's join is taken on the live path (the survivors re-form their
process group without restarting) while a kill still takes the restart path
with the just-in-time save. Reported, per variant:

* **goodput**: steps the churned job advanced over the window / steps the
  reference advanced over the same window;
* **steps lost per kill**: the last step completed before the kill minus the
  step the survivors resumed from;
* **where each kill's seconds go** (medians over kills, from the runners' and
  workers' logs): *notice* (kill to the survivors' runner stopping its broken
  group), *save* (the runner's wait for just-in-time saves), *rendezvous*
  (until the last survivor's new round), *start-up* (until the first step
  after the kill), *redo* (steps lost x the mean step time);
* **each join**: the path the survivors' runners took (live, or a restart),
  the training pause (the longest gap between two consecutive new steps of
  the job from the last step before the fresh node was given the job to the
  third step at world size 3), and the runner's own figure for a live resize
  (from seeing the joiner to every worker resized).

No assertion is made on time or goodput.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment
from tests.bench.bench_recovery import MARKER, _no_leftovers, _stamp
from tests.support.agents import AgentCluster, assign, unassign
from tests.support.processes import ProcessGroupRegistry

MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
WINDOW_S = float(os.environ.get("BENCH_CHURN_SECONDS", "600"))
PERIOD_S = float(os.environ.get("BENCH_CHURN_PERIOD", "30"))
STEP_SECONDS = 0.1
EVERY_STEPS = 100
START_DEADLINE_S = 180.0
ARGS = ["--total-steps", str(10**7), "--every-steps", str(EVERY_STEPS),
        "--step-seconds", str(STEP_SECONDS), "--dataset-size", "4096"]
_STEP = re.compile(r"rank \d+ world_size (\d+) step (\d+) loss")
_START = re.compile(r"start at step (\d+) ")
_LIVE_DONE = re.compile(r"resized into round \d+ live in ([\d.]+) s")
_RESTARTED = ("restarting the group", "did not complete")
PAUSE_STEPS = 3  # a join's pause ends at the third step at the full size


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


def steps_of(lines: list[Line]) -> list[tuple[float, int]]:
    """(time, completed steps) of every step line."""
    return [(ln.time, int(m.group(2)) + 1) for ln in lines if (m := _STEP.search(ln.text))]


def sized_steps(lines: list[Line]) -> list[tuple[float, int, int]]:
    """(time, completed steps, world size) of every step line."""
    return [(ln.time, int(m.group(2)) + 1, int(m.group(1)))
            for ln in lines if (m := _STEP.search(ln.text))]


def frontier(steps: list[tuple[float, int]], at: float) -> int:
    """The step count of the newest step line at or before ``at`` (0 if none)."""
    before = [s for t, s in steps if t <= at]
    return before[-1] if before else 0


@dataclasses.dataclass
class Kill:
    at: float
    victim: str
    lost: int | None = None
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    joined_at: float | None = None  # when the fresh node was given the job
    join_path: str | None = None  # "live" or "restart", from the survivors' runners
    join_pause: float | None = None  # the longest gap between new steps around the join
    live_s: float | None = None  # the runners' own figure for the live resize


@dataclasses.dataclass
class Variant:
    name: str
    goodput: float | None = None
    kept: int = 0
    reference: int = 0
    kills: list[Kill] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def analyse_kill(kill: Kill, worker: list[Line], runner: list[Line], survivors: set[str],
                 step_s: float, until: float) -> None:
    """Steps lost and where the seconds went, for one kill (None: no restart before ``until``,
    the next kill or the window's end)."""
    after = [ln for ln in worker if kill.at < ln.time < until and ln.node in survivors]
    start = next((ln for ln in after if _START.search(ln.text)), None)
    if start is None:
        return
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
    # The job's new steps (the first line of each step number), in time order.
    firsts: list[tuple[float, int, int]] = []
    top = 0
    for t, step, size in sized_steps(worker):
        if step > top:
            firsts.append((t, step, size))
            top = step
    before = [s for s in firsts if s[0] <= at]
    after = [s for s in firsts if s[0] > at and s[2] == full and s[0] < until][:PAUSE_STEPS]
    if not before or len(after) < PAUSE_STEPS:
        return
    window = [s for s in firsts if before[-1][0] <= s[0] <= after[-1][0]]
    kill.join_pause = max(b[0] - a[0] for a, b in itertools.pairwise(window))


def _warm(workdir: Path, node: str) -> bool:
    """Whether the node's warm runner has imported torch and its zygote is up."""
    logs = [p.read_text(errors="replace") for p in (workdir / node / "warm").glob("*.log")]
    return any("zygote ready" in t and "ready for a job" in t for t in logs)


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
    ref_log = workdir / "reference.log"
    try:
        procs.spawn(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
             str(MLP), "--checkpoint-dir", str(workdir / "ref-ckpt"), *ARGS],
            log_path=ref_log, env=dict(os.environ, OMP_NUM_THREADS="1", TIDAL_JIT_SAVE="0"),
        )
        live = ["n0", "n1", "n2"]
        for node in live:
            cluster.start_agent(node)
        for node in live:
            assign(client, node, job)
        fresh = len(live)
        spare = f"n{fresh}"
        fresh += 1
        cluster.start_agent(spare)

        def worker_logs() -> list[tuple[str, Path]]:
            return [(n, p) for n in cluster.agents for p in sorted((workdir / n).rglob("*.log"))
                    if p.name != "runner.log" and "warm" not in p.parts]

        def runner_logs() -> list[tuple[str, Path]]:
            return [(n, p) for n in cluster.agents for p in (workdir / n).rglob("runner*.log")]

        give_up = time.monotonic() + START_DEADLINE_S
        while True:
            sizes = {int(m.group(1)) for ln in read_lines(worker_logs())[-30:]
                     if (m := _STEP.search(ln.text))}
            ref_going = bool(steps_of(read_lines([("ref", ref_log)])[-5:]))
            if 3 in sizes and ref_going and _warm(workdir, spare):
                break
            if time.monotonic() > give_up:
                out.notes.append("the jobs never both trained")
                return out
            time.sleep(0.5)
        t0 = time.time()
        kill_at = t0 + PERIOD_S / 4
        while kill_at < t0 + WINDOW_S - 3 * PERIOD_S / 4:
            time.sleep(max(0.0, kill_at - time.time()))
            victim = live.pop(0)
            out.kills.append(Kill(at=time.time(), victim=victim))
            cluster.kill_agent(victim)
            unassign(client, victim, job.job_id)
            time.sleep(max(0.0, kill_at + PERIOD_S / 2 - time.time()))
            ready_by = kill_at + PERIOD_S
            while not _warm(workdir, spare) and time.time() < ready_by:
                time.sleep(0.2)
            assign(client, spare, job)
            out.kills[-1].joined_at = time.time()
            live.append(spare)
            spare = f"n{fresh}"
            fresh += 1
            cluster.start_agent(spare)
            kill_at += PERIOD_S
        time.sleep(max(0.0, t0 + WINDOW_S - time.time()))
        t_end = time.time()
        worker = read_lines(worker_logs())
        runner = read_lines(runner_logs())
        steps = steps_of(worker)
        ref = steps_of(read_lines([("ref", ref_log)]))
        out.kept = frontier(steps, t_end) - frontier(steps, t0)
        out.reference = frontier(ref, t_end) - frontier(ref, t0)
        out.goodput = out.kept / out.reference if out.reference else None
        intervals = [b[0] - a[0] for a, b in itertools.pairwise(ref) if b[1] == a[1] + 1]
        step_s = statistics.median(intervals) if intervals else STEP_SECONDS
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


def report(variants: list[Variant], load: tuple[float, float]) -> str:
    keys = ("notice", "save", "rendezvous", "start-up", "redo")
    lines = [
        f"window {WINDOW_S:g} s per variant, a kill and a fresh node every {PERIOD_S:g} s, "
        f"every_steps={EVERY_STEPS}, step paced at {STEP_SECONDS} s; {os.cpu_count()} cores, "
        f"1-min load {load[0]:.1f} at the start, {load[1]:.1f} at the end",
        "",
        "| variant | goodput | steps kept / reference | kills | steps lost per kill "
        "(median / worst) | " + " | ".join(f"{k} median (s)" for k in keys)
        + " | joins live / all | join pause median / worst (s) |",
        "|---|---|---|---|---|" + "---|" * len(keys) + "---|---|",
    ]
    for v in variants:
        lost = [k.lost for k in v.kills if k.lost is not None]
        parts = [k.parts for k in v.kills if k.parts]
        pauses = [k.join_pause for k in v.kills if k.join_pause is not None]
        cells = [
            v.name,
            f"{100 * v.goodput:.1f}%" if v.goodput is not None else "-",
            f"{v.kept} / {v.reference}",
            str(len(v.kills)),
            f"{statistics.median(lost):g} / {max(lost)}" if lost else "-",
            *[f"{statistics.median(p[k] for p in parts):.2f}" if parts else "-" for k in keys],
            f"{sum(k.join_path == 'live' for k in v.kills)} / "
            f"{sum(k.joined_at is not None for k in v.kills)}",
            f"{statistics.median(pauses):.2f} / {max(pauses):.2f}" if pauses else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for v in variants:
        lines += [f"{v.name}: kill {i + 1} at +{k.at - v.kills[0].at:.0f} s: "
                  + ("no restart before the next kill" if k.lost is None else f"lost {k.lost}, ")
                  + ", ".join(f"{n} {s:.2f}" for n, s in k.parts.items())
                  + f"; join +{(k.joined_at or k.at) - k.at:.1f} s after the kill: "
                  + f"path {k.join_path or '-'}, pause "
                  + ("-" if k.join_pause is None else f"{k.join_pause:.2f} s")
                  + ("" if k.live_s is None else f", runner's live resize {k.live_s:.2f} s")
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
             "live": ("JIT save on + live joins", True, True)}
    for name, (label, jit, live_resize) in known.items():
        if name not in wanted:
            continue
        with _no_leftovers(ProcessGroupRegistry(), marker):
            variants.append(run_variant(
                label, jit, live_resize, tmp_path / name, etcd_server, f"{etcd_root}-{name}"
            ))
        print(f"\n{variants[-1]}")
    print("\n" + report(variants, (load_start, os.getloadavg()[0])))
    assert variants
