"""The command line's small habits on a real coordinator: `submit --no-wait` says
what to type next, tables and labelled values fit $COLUMNS (and a pipe gets
everything), and `--json` answers the API's JSON."""

from __future__ import annotations

import json
import shlex
import sys

from tests.integration.service.cli import test_cli
from tests.integration.service.cli.test_cli import JOB_ID_RE, Coordinator, ok, tidal
from tests.support.wait import wait_for

coordinator = test_cli.coordinator  # the same fixture: a real coordinator, no agent

# A command longer than any terminal, so that the tables must cut it.
LONG = [sys.executable, "-c", "pass # " + " ".join(f"padding-{i}" for i in range(30))]


def test_submit_no_wait_prints_the_id_and_how_to_follow_read_and_stop_the_job(
    coordinator: Coordinator,
) -> None:
    env = coordinator.env()
    result = tidal("submit", "--no-wait", "--name", "later", "--", *LONG, env=env)
    job = ok(result).strip()
    assert JOB_ID_RE.match(job), result.stdout  # stdout: the id alone, for $(...)
    for command in (f"tidal status {job} --watch", f"tidal logs {job} -f",
                    f"tidal cancel {job}"):
        assert command in result.stderr, result.stderr

    view = json.loads(ok(tidal("submit", "--no-wait", "--json", "--name", "as-json", "--",
                               *LONG, env=env)))
    assert view["phase"] == "PENDING" and view["job_id"].startswith("as-json-")
    cancelled = json.loads(ok(tidal("cancel", view["job_id"], "--json", env=env)))
    assert cancelled["cancel_requested"] is True

    # Followed with --json: one JSON line per change (no agent here: it waits, then --timeout).
    followed = tidal("submit", "--json", "--timeout", "1", "--name", "followed", "--", *LONG,
                     env=env)
    assert followed.returncode == 7, followed
    first = json.loads(followed.stdout.splitlines()[0])
    assert first["phase"] == "PENDING" and first["job_id"].startswith("followed-")
    assert followed.stderr.startswith(f"error: job {first['job_id']} did not finish"), followed
    ok(tidal("cancel", first["job_id"], env=env))
    wait_for(lambda: coordinator.get(f"/v1/jobs/{view['job_id']}")["phase"] == "CANCELLED",
             timeout=30, what="the JSON job CANCELLED")


def test_tables_fit_columns_and_a_pipe_gets_every_character(coordinator: Coordinator) -> None:
    env = coordinator.env()
    job = ok(tidal("submit", "--no-wait", "--name", "wide", "--", *LONG, env=env)).strip()

    piped = ok(tidal("jobs", env=env))
    assert shlex.join(LONG) in piped  # no COLUMNS and not a terminal: nothing is cut
    narrow = ok(tidal("jobs", env={**env, "COLUMNS": "90"})).splitlines()
    assert narrow[0].split()[:3] == ["JOB", "PHASE", "NODES"]
    assert all(len(line) <= 90 for line in narrow), narrow
    assert narrow[1].startswith(job + " ") and narrow[1].endswith("…"), narrow

    events = ok(tidal("events", job, env={**env, "COLUMNS": "75"})).splitlines()
    assert all(len(line) <= 75 for line in events), events
    assert events[0].split()[:4] == ["SEQ", "TIME", "PHASE", "REASON"]

    status = ok(tidal("status", job, env={**env, "COLUMNS": "60"})).splitlines()
    assert all(len(line) <= 60 for line in status), status
    command = next(i for i, line in enumerate(status) if line.startswith("command:"))
    assert status[command + 1].startswith(" " * 10)  # the long command wraps under itself
    assert "padding-29" in "".join(status)  # wrapped, not cut
    ok(tidal("cancel", job, env=env))
