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

The driver (``tidal up``, the job, the events and how each is measured) is
tests/support/frameworks.py, shared with tests/e2e/test_frameworks.py, whose
jobs go through the events faster (a smaller pace, fewer steady steps) and
assert on the steps redone. Each job here trains tens of seconds per phase;
the whole run takes 10 to 15 minutes on the shared 2-core machine. Every
process started here (``tidal up`` leads a process group; its children lead
theirs) is stopped at the end of each job, on failure too. No assertion is made on time.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.bench.bench_recovery import _load, _load_text
from tests.support.frameworks import (
    FRAMEWORKS,
    Job,
    Measured,
    Pace,
    Up,
    drain,
    job_spec,
    join,
    kill,
    leftovers,
    patch,
    paths,
)
from tests.support.processes import ProcessGroupRegistry

ARMS = {"on": True, "off": False}
PACE = Pace(step_seconds=0.1, save_steps=25, grace_s=15, steady_steps=30,
            up_deadline_s=180.0, event_deadline_s=180.0)


@dataclass
class JobRun:
    framework: str
    callback: bool
    events: list[Measured] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_job(framework: str, callback: bool, workdir: Path, procs: ProcessGroupRegistry) -> JobRun:
    """tidal up, one job through kill, join, PATCH and drain; tidal up stopped at the end."""
    run = JobRun(framework, callback)
    up = Up(workdir / "state", procs, deadline_s=PACE.up_deadline_s)
    job: Job | None = None
    try:
        job = Job(up, job_spec(framework, callback, workdir / "out", PACE), workdir / "out", PACE)
        job.steady(0, 3)
        _events(up, job, run)
    except Exception as exc:  # a job that fails is reported, and the next one runs
        run.notes.append(f"{type(exc).__name__}: {exc}")
        print(f"\nlast lines of {up.log}:\n{up.log_tail()}")
    finally:
        if job is not None:
            with contextlib.suppress(httpx.HTTPError, RuntimeError):
                paths(job.events(), run.events, time.time())
                up.api.post(f"/v1/jobs/{job.id}/cancel")
        up.stop()
    return run


def _events(up: Up, job: Job, run: JobRun) -> None:
    """kill, join (size 3), PATCH max_nodes 3 -> 2, drain (the third node takes its place)."""
    m, victim, old_pid = kill(up, job)
    run.events.append(m)
    run.events.append(join(up, job, victim, old_pid, m.at))
    job.steady(run.events[-1].at, 3)
    run.events.append(patch(up, job, 2, max_nodes=2))
    job.steady(run.events[-1].at, 2)
    run.events.append(drain(up, job, 2))
    job.steady(run.events[-1].at, 2)


# The report --------------------------------------------------------------------------------


def report(runs: list[JobRun], loads: list[tuple[float, float, float]]) -> str:
    lines = [
        f"{_load_text(loads)}; a step every {PACE.step_seconds} s (sleep) plus compute; the "
        f"framework's own checkpoint every {PACE.save_steps} steps; grace {PACE.grace_s} s",
        "",
        "| framework | callback | event | path | steps redone | gap (s) | pause (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for m in run.events:
            redone = "-" if m.redone is None else str(m.redone)
            gap = f"> {PACE.event_deadline_s:g}" if m.gap_s is None else f"{m.gap_s:.1f}"
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


@pytest.mark.bench
@pytest.mark.timeout(2400)
def test_bench_frameworks_with_and_without_the_callback(tmp_path: Path) -> None:
    runs: list[JobRun] = []
    loads = [_load()]
    for framework in _chosen("BENCH_FRAMEWORKS", list(FRAMEWORKS)):
        for arm in _chosen("BENCH_FRAMEWORKS_ARMS", list(ARMS)):
            workdir = tmp_path / f"{framework}-{arm}"
            workdir.mkdir()
            procs = ProcessGroupRegistry()
            began = time.monotonic()
            with leftovers(procs):
                run = run_job(framework, ARMS[arm], workdir, procs)
            runs.append(run)
            loads.append(_load())
            print(f"\n{framework}, callback {arm}: {len(run.events)} event(s) in "
                  f"{time.monotonic() - began:.0f} s, notes {run.notes} "
                  f"(1-min load {loads[-1][0]:.2f}; logs in {workdir})", flush=True)
    print("\n" + report(runs, loads))
    assert runs and all(len(r.events) == 4 and not r.notes for r in runs)
