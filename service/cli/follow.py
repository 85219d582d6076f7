"""Following a job from the `tidal` command line until it ends: ``tidal submit``
(unless ``--no-wait``) and ``tidal status --watch``.

:class:`Follower` polls the job and its new events, rides out a short outage of
the coordinator (``OUTAGE_TOLERANCE_S``) and stops at a terminal phase or at
``--timeout`` (exit 7). :func:`follow_human` prints the events, the progress and,
for ``submit``, the workers' output (the pieces of :mod:`service.cli.console`), then
the outcome; :func:`follow_json` prints the job's view as one JSON line per
change. Both return the exit code of the job's phase (``PHASE_EXIT``), or 130
on Ctrl-C (the job goes on). Used by :mod:`service.cli.jobs`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import click

from service.api.models import JobEvent, JobPhase, JobView
from service.cli.console import FollowConsole, LogStreamer, StepRate, progress_of
from service.cli.views import error_lines, event_line
from service.client import (
    EXIT_INTERRUPTED,
    PHASE_EXIT,
    ApiError,
    Client,
    WaitTimeoutError,
)
from service.client.calls import OUTAGE_TOLERANCE_S, POLL_INTERVAL_S

# Seconds a follower waits, once the job ended, for the last of its logs.
LOGS_DRAIN_S = 30.0


@dataclass
class Follower:
    """Polls a job and its events until the job is terminal, tolerating short outages."""

    client: Client
    job_id: str
    timeout_s: float | None = None
    with_events: bool = True
    seen_seq: int = -1
    outage_since: float | None = None
    _warned: bool = field(default=False, repr=False)

    def poll(self) -> tuple[JobView, list[JobEvent]] | None:
        """The job and its events not seen yet; None during an outage."""
        try:
            view = self.client.get_job(self.job_id)
            events = [] if not self.with_events else [
                e for e in self.client.events(self.job_id).events if e.seq > self.seen_seq]
        except ApiError as exc:
            if not exc.transient:
                raise
            now = time.monotonic()
            if self.outage_since is None:
                self.outage_since = now
            if now - self.outage_since > OUTAGE_TOLERANCE_S:
                raise
            if not self._warned:
                click.echo(f"warning: {exc.message}; retrying for up to "
                           f"{OUTAGE_TOLERANCE_S:g} s", err=True)
                self._warned = True
            return None
        self.outage_since = None
        self._warned = False
        if events:
            self.seen_seq = events[-1].seq
        return view, events

    def run(self, on_update: Callable[[JobView, list[JobEvent]], None]) -> JobView:
        """Call ``on_update`` on every poll until the job is terminal; return its last view.

        Raises:
            WaitTimeoutError: ``timeout_s`` passed first (exit 7).
            ApiError: the coordinator refused, or stayed away too long.
        """
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            got = self.poll()
            if got is not None:
                view, events = got
                on_update(view, events)
                if view.phase.is_terminal():
                    return view
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"job {self.job_id} did not finish within --timeout {self.timeout_s:g} s; "
                    "it goes on", job_id=self.job_id)
            time.sleep(POLL_INTERVAL_S)


def follow_human(client: Client, job_id: str, *, timeout_s: float | None,
                 logs: bool = False) -> int:
    """Print the job's events as they come, its progress (service.cli.console: a bar on a
    terminal, a plain line now and then elsewhere) and, with ``logs``, its workers'
    output streamed from the coordinator; then its outcome. Returns the exit code."""
    console = FollowConsole.for_stdout()
    streamer = LogStreamer(client, job_id, console).start() if logs else None
    rate = StepRate()

    def show(view: JobView, events: list[JobEvent]) -> None:
        for event in events:
            console.line(event_line(event))
        rate.observe(time.monotonic(), view.last_step)
        console.progress(progress_of(view, now=datetime.now(timezone.utc),
                                     steps_per_second=rate.steps_per_second()))

    try:
        view = Follower(client, job_id, timeout_s=timeout_s).run(show)
        if streamer is not None and not streamer.join(LOGS_DRAIN_S):
            console.line(f"warning: the job's last output did not come within "
                         f"{LOGS_DRAIN_S:g} s; `tidal logs {job_id}` reads it", err=True)
    except KeyboardInterrupt:
        console.finish()
        click.echo(f"\nstopped following job {job_id}; it goes on "
                   f"(`tidal cancel {job_id}` stops it)", err=True)
        return EXIT_INTERRUPTED
    finally:
        console.finish()
    took = ""
    if view.started_at and view.finished_at:
        took = f" after {(view.finished_at - view.started_at).total_seconds():.1f} s"
    click.echo(f"job {job_id} {view.phase.value}{took}")
    for line in error_lines(view):
        click.echo(line, err=True)
    if view.phase == JobPhase.FAILED:
        click.echo(f"its output: tidal logs {job_id}", err=True)
    return PHASE_EXIT[view.phase]


def follow_json(client: Client, job_id: str, *, timeout_s: float | None) -> int:
    """Print the job's view as one JSON line each time it changes."""
    last: dict[str, Any] = {}

    def show(view: JobView, _: list[JobEvent]) -> None:
        nonlocal last
        data = view.model_dump(mode="json")
        if data != last:
            click.echo(json.dumps(data))
            last = data

    try:
        view = Follower(client, job_id, timeout_s=timeout_s).run(show)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return PHASE_EXIT[view.phase]
