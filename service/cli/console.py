"""What `tidal submit` and `tidal status --watch` show while a job runs.

* progress: step (of the total, when the workers report one), throughput,
  loss, world size, time since the last checkpoint and an estimate of the time
  left. The formatting is pure (:func:`progress_of`, :func:`progress_line`,
  :func:`progress_bar`, :func:`should_print`): a bar redrawn in place when
  stdout is a terminal, a plain line now and then when it is not (a log file,
  a CI job);
* the job's logs, streamed from the coordinator in a thread
  (:class:`LogStreamer`), printed above the bar (:class:`FollowConsole`).
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from service.api.models import JobPhase, JobView
from service.client import ApiError, Client

#: A plain progress line is printed at most this often (unless the world size changed).
PLAIN_EVERY_S = 10.0
#: Observations of the step kept for the rate, and how old they may be.
RATE_WINDOW = 30
RATE_MAX_AGE_S = 120.0
_CLEAR = "\r\x1b[K"
_LOG_LINE = re.compile(r"^\[(?P<node>[A-Za-z0-9][A-Za-z0-9._-]*) r(?P<rank>[0-9]+)\] (?P<text>.*)$",
                       re.DOTALL)


# pure formatting -----------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``, ``2d03h``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def throughput(samples_per_second: float) -> str:
    """``812 samples/s``, ``12.3k samples/s``, ``1.5M samples/s``."""
    value = max(0.0, samples_per_second)
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit} samples/s"
    return f"{value:.3g} samples/s" if value < 10 else f"{value:.0f} samples/s"


@dataclass(frozen=True)
class Progress:
    """What a person following a job waits for; None where not known (yet)."""

    phase: JobPhase
    world_size: int
    step: int | None = None
    total_steps: int | None = None
    samples_per_second: float | None = None
    loss: float | None = None
    checkpoint_age_s: float | None = None
    eta_s: float | None = None

    @property
    def fraction(self) -> float | None:
        if self.step is None or not self.total_steps:
            return None
        return min(1.0, max(0.0, self.step / self.total_steps))

    @property
    def shown(self) -> bool:
        """Whether there is anything to show beyond the phase (the events say that)."""
        return self.step is not None or self.world_size > 0


class StepRate:
    """Steps per second, from the steps seen at known times (a window of them).

    A step lower than the last one (the job went back to a checkpoint) starts
    over, so a restart does not make the rate negative.
    """

    def __init__(self, *, window: int = RATE_WINDOW, max_age_s: float = RATE_MAX_AGE_S) -> None:
        self._seen: deque[tuple[float, int]] = deque(maxlen=window)
        self._max_age_s = max_age_s

    def observe(self, now: float, step: int | None) -> None:
        if step is None:
            return
        if self._seen and step < self._seen[-1][1]:
            self._seen.clear()
        if self._seen and step == self._seen[-1][1]:
            return  # the same report again: its time is when it was first seen
        self._seen.append((now, step))
        while len(self._seen) > 2 and now - self._seen[0][0] > self._max_age_s:
            self._seen.popleft()

    def steps_per_second(self) -> float | None:
        if len(self._seen) < 2:
            return None
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


def progress_of(view: JobView, *, now: datetime, steps_per_second: float | None) -> Progress:
    """The job's :class:`Progress` as of ``now``; the time left needs the total and a rate."""
    age = None
    if view.last_checkpoint_at is not None:
        age = max(0.0, (now - view.last_checkpoint_at).total_seconds())
    eta = None
    total, step = view.total_steps, view.last_step
    if total is not None and step is not None and steps_per_second and step <= total:
        eta = (total - step) / steps_per_second
    return Progress(
        phase=view.phase, world_size=view.world_size, step=step, total_steps=total,
        samples_per_second=view.samples_per_second, loss=view.loss,
        checkpoint_age_s=age, eta_s=eta,
    )


def progress_fields(p: Progress) -> list[str]:
    """The known parts of ``p``, each a few words."""
    parts = []
    if p.step is not None:
        parts.append(f"step {p.step}" + (f"/{p.total_steps}" if p.total_steps else ""))
    if p.samples_per_second is not None:
        parts.append(throughput(p.samples_per_second))
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4g}")
    parts.append(f"world size {p.world_size}")
    if p.checkpoint_age_s is not None:
        parts.append(f"checkpoint {duration(p.checkpoint_age_s)} ago")
    if p.eta_s is not None:
        parts.append(f"about {duration(p.eta_s)} left")
    return parts


def progress_line(p: Progress) -> str:
    """One plain line: ``progress: step 120/1000, 812 samples/s, loss 2.31, ...``."""
    return "progress: " + ", ".join(progress_fields(p))


def progress_bar(p: Progress, width: int) -> str:
    """A bar and the fields, at most ``width - 1`` characters (the cursor's column stays
    free, so no terminal wraps it): ``[=====>    ]  52%  step 520/1000 · ...``."""
    text = " · ".join(progress_fields(p))
    fraction = p.fraction
    if fraction is not None:
        cells = max(10, min(30, width // 4))
        done = int(fraction * cells)
        arrow = ">" if done < cells else ""
        bar = "[" + "=" * done + arrow + " " * (cells - done - len(arrow)) + "]"
        text = f"{bar} {fraction * 100:3.0f}%  {text}"
    limit = max(1, width - 1)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def should_print(new: Progress, last: Progress | None, *, since_last_s: float,
                 every_s: float = PLAIN_EVERY_S) -> bool:
    """Whether a plain (non-terminal) follower prints ``new`` after ``last``: the first
    time there is something, when the world size changes, and otherwise at most every
    ``every_s`` seconds while the step moves."""
    if not new.shown:
        return False
    if last is None or not last.shown or new.world_size != last.world_size:
        return True
    return since_last_s >= every_s and new.step != last.step


# printing ------------------------------------------------------------------------------


class FollowConsole:
    """Lines (events, logs) above one progress display; safe from several threads.

    On a terminal the progress is a bar redrawn in place under the lines; elsewhere
    it is a plain line now and then (:func:`should_print`).

    Args:
        out: where everything goes (stdout).
        tty: whether ``out`` is a terminal.
        width: the terminal's width now.
        clock: monotonic seconds.
    """

    def __init__(self, out: TextIO, *, tty: bool, width: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.tty = tty
        self.width = width or (lambda: shutil.get_terminal_size((100, 24)).columns)
        self.clock = clock
        self._lock = threading.Lock()
        self._bar = ""  # the bar on screen now (terminal)
        self._last: Progress | None = None
        self._last_at = 0.0

    @classmethod
    def for_stdout(cls) -> FollowConsole:
        return cls(sys.stdout, tty=sys.stdout.isatty())

    def line(self, text: str, *, err: bool = False) -> None:
        """Print a line (on stderr with ``err``), above the bar."""
        with self._lock:
            if self.tty and self._bar:
                self.out.write(_CLEAR)
            target = sys.stderr if err else self.out
            if err:
                self.out.flush()
            target.write(text + "\n")
            target.flush()
            if self.tty and self._bar:
                self.out.write(self._bar)
            self.out.flush()

    def progress(self, p: Progress) -> None:
        """Show ``p``: redraw the bar, or print a plain line when it is time."""
        with self._lock:
            now = self.clock()
            if self.tty:
                if not p.shown:
                    return
                self._bar = progress_bar(p, self.width())
                self.out.write(_CLEAR + self._bar)
                self.out.flush()
            elif should_print(p, self._last, since_last_s=now - self._last_at):
                self._last, self._last_at = p, now
                self.out.write(progress_line(p) + "\n")
                self.out.flush()

    def finish(self) -> None:
        """Take the bar off the screen (before the outcome is printed)."""
        with self._lock:
            if self.tty and self._bar:
                self.out.write(_CLEAR)
                self.out.flush()
            self._bar = ""


class LogStreamer:
    """Prints a job's logs (followed, through the coordinator) on a console, in a thread.

    Args:
        client: a client of the coordinator (its URL and token are used for a
            connection of the thread's own).
        job_id: the job.
        console: where the lines go.
    """

    def __init__(self, client: Client, job_id: str, console: FollowConsole) -> None:
        self.url, self.token = client.url, client.target.token
        self.job_id = job_id
        self.console = console
        self._thread = threading.Thread(target=self._run, name="logs", daemon=True)

    def start(self) -> LogStreamer:
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Wait for the stream's end (it ends once the job ended); False if it did not."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            with Client(self.url, self.token) as client:
                for line in client.logs(self.job_id, follow=True):
                    self.console.line(line)
        except ApiError as exc:
            self.console.line(f"warning: the job's logs stopped: {exc.message} "
                              f"(`tidal logs {self.job_id}` reads them)", err=True)


def parse_log_line(line: str) -> dict[str, Any]:
    """A line of the log route as ``tidal logs --json`` prints it: ``{"node", "rank",
    "line"}`` for a worker's line, ``{"tidal": message}`` for the coordinator's news."""
    if line.startswith("[tidal] "):
        return {"tidal": line[len("[tidal] "):]}
    match = _LOG_LINE.match(line)
    if match is None:
        return {"line": line}
    return {"node": match["node"], "rank": int(match["rank"]), "line": match["text"]}
