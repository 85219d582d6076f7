"""Progress reporting from a worker to its node agent: one small JSON file per rank.

When ``TIDAL_PROGRESS_DIR`` is set (the agent sets it), each rank keeps
``<dir>/rank-<RANK>.json`` up to date, at most once per ``interval`` seconds,
by writing a temporary file and renaming it over the old one (readers never
see half a file). Nothing is fsynced: this is live status, not durable state.
Under plain torchrun or a single process the variable is unset and
:class:`NullProgressReporter` does nothing. The agent turns the files into
Prometheus metrics at scrape time; workers never serve metrics themselves,
so nothing piles up across restarts the way prometheus_client's
multiprocess files do.

The per-step cost is a few attribute updates: a loss tensor is kept by
reference and converted with ``.item()`` only when the file is written, so no
step waits for the device. The file format is in docs/checkpoints.md; its
fields are :data:`PROGRESS_FIELDS`, its model :class:`checkpoints.protocol.progress.ProgressReport`.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from checkpoints.protocol import env as worker_env
from checkpoints.protocol.progress import (
    PROGRESS_FIELDS,
    PROGRESS_FORMAT,
    PROGRESS_VERSION,
    ProgressReport,
    file_name,
)

__all__ = [
    "PROGRESS_DIR_ENV",
    "PROGRESS_FIELDS",
    "PROGRESS_FORMAT",
    "PROGRESS_VERSION",
    "FileProgressReporter",
    "NullProgressReporter",
    "ProgressReporter",
    "create_progress_reporter",
]

log = logging.getLogger(__name__)

PROGRESS_DIR_ENV = worker_env.PROGRESS_DIR


class ProgressReporter(abc.ABC):
    """Where a worker reports its progress.

    Contract: every method is cheap and never raises (a failure to report must
    not stop training); ``record`` is called once per step and must not wait
    for the device.
    """

    @abc.abstractmethod
    def record(self, *, step: int, loss: Any = None, samples: int | None = None) -> None:
        """Note that ``step`` steps are complete, with this step's loss and sample count."""

    def set_total_steps(self, total: int | None) -> None:
        """The step training ends at, when known (an estimate of the time left uses it).

        Not abstract: a reporter without it reports no total."""
        return None  # optional for reporters, so not abstract

    @abc.abstractmethod
    def checkpoint_saved(
        self, *, step: int, wall_time: float, save_seconds: float, stall_seconds: float
    ) -> None:
        """Note a committed checkpoint: its step, Unix time, total and blocking durations."""

    @abc.abstractmethod
    def save_failed(self, error: str) -> None:
        """Note that a save failed (cleared by the next successful one)."""

    @abc.abstractmethod
    def stop_requested(self) -> None:
        """Note that the worker was asked to stop (SIGTERM)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Report now, whatever the interval."""

    def rebind(self, *, rank: int, world_size: int) -> None:
        """Report as ``rank`` of ``world_size`` from now on (a live resize changed them).

        Not abstract: a reporter that does not name the rank has nothing to change."""
        return None

    def set_pace_source(self, source: Callable[[], Sequence[tuple[int, float]]] | None) -> None:
        """Where the rank's recent paces come from (:meth:`checkpoints.pace.PaceMeter.recent`),
        asked only when a report is written.

        Not abstract: a reporter that does not report paces ignores it."""
        return None


class NullProgressReporter(ProgressReporter):
    """Reports nothing: the twin used outside tidal."""

    def record(self, *, step: int, loss: Any = None, samples: int | None = None) -> None:
        """Do nothing."""

    def checkpoint_saved(
        self, *, step: int, wall_time: float, save_seconds: float, stall_seconds: float
    ) -> None:
        """Do nothing."""

    def save_failed(self, error: str) -> None:
        """Do nothing."""

    def stop_requested(self) -> None:
        """Do nothing."""

    def flush(self) -> None:
        """Do nothing."""


class FileProgressReporter(ProgressReporter):
    """Writes ``rank-<rank>.json`` in ``directory`` atomically, at most once per interval.

    Args:
        directory: created if missing.
        rank: this worker's global rank.
        world_size: the job's current world size.
        restart_count: how often the worker group was restarted, when known.
        interval: minimum seconds between writes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        restart_count: int | None = None,
        interval: float = 1.0,
    ) -> None:
        self.path = Path(directory) / file_name(rank)
        self._temp = self.path.with_name(f".{file_name(rank)}.tmp")
        self._interval = interval
        self._fixed: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "restart_count": restart_count,
        }
        self._step: int | None = None
        # When this process completed its first step: the agent measures a
        # recovery as "failure noticed -> first step of the new workers".
        self._first_step_time: float | None = None
        # Goodput (agent.runner.status): the first step this process completed (its
        # resume step + 1), when it completed its latest, and how long its
        # saves blocked training in all.
        self._first_step: int | None = None
        self._last_step_time: float | None = None
        self._stall_total = 0.0
        self._loss: Any = None
        self._samples = 0
        self._window_start = time.monotonic()
        self._rate: float | None = None
        self._last_write = float("-inf")
        self._checkpoint: dict[str, Any] = {}
        self._error: str | None = None
        self._stop = False
        self._total_steps: int | None = None
        self._paces: Callable[[], Sequence[tuple[int, float]]] | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("progress directory %s is unusable: %s", self.path.parent, exc)

    def record(self, *, step: int, loss: Any = None, samples: int | None = None) -> None:
        """Remember this step; write the file if the interval has passed."""
        self._step = step
        self._last_step_time = time.time()
        if self._first_step_time is None:
            self._first_step_time = self._last_step_time
            self._first_step = step
        if loss is not None:
            self._loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if samples:
            self._samples += samples
        now = time.monotonic()
        if now - self._last_write >= self._interval:
            self._write(now)

    def set_total_steps(self, total: int | None) -> None:
        """Remember the total (written with the next report)."""
        self._total_steps = total if total is None or total >= 0 else None

    def checkpoint_saved(
        self, *, step: int, wall_time: float, save_seconds: float, stall_seconds: float
    ) -> None:
        """Remember the committed checkpoint (written with the next report)."""
        self._stall_total += max(0.0, stall_seconds)
        self._checkpoint = {
            "last_checkpoint_step": step,
            "last_checkpoint_time": wall_time,
            "last_save_seconds": round(save_seconds, 6),
            "last_stall_seconds": round(stall_seconds, 6),
        }
        self._error = None

    def save_failed(self, error: str) -> None:
        """Remember the failure and report it now."""
        self._error = error
        self.flush()

    def stop_requested(self) -> None:
        """Remember the stop request and report it now."""
        self._stop = True
        self.flush()

    def flush(self) -> None:
        """Write the file now."""
        self._write(time.monotonic())

    def rebind(self, *, rank: int, world_size: int) -> None:
        """Write ``rank-<rank>.json`` from now on, and remove this process's old file.

        The counters (first step, stall time, the rate window) go on: it is the
        same process training on.
        """
        if rank == self._fixed["rank"] and world_size == self._fixed["world_size"]:
            return
        old = self.path
        self.path = old.with_name(file_name(rank))
        self._temp = old.with_name(f".{file_name(rank)}.tmp")
        self._fixed.update(rank=rank, world_size=world_size)
        with contextlib.suppress(OSError):
            os.unlink(old)  # another local rank may take that name: it writes it again
        self.flush()

    def set_pace_source(self, source: Callable[[], Sequence[tuple[int, float]]] | None) -> None:
        """Report the paces ``source`` gives with every write from now on."""
        self._paces = source

    def snapshot(self) -> dict[str, Any]:
        """The report as it would be written now (converts the loss)."""
        loss = self._loss
        if isinstance(loss, torch.Tensor):
            loss = loss.float().mean().item() if loss.numel() else None
        body: dict[str, Any] = dict(self._fixed)
        body.update(
            time=time.time(),
            first_step_time=self._first_step_time,
            step=self._step,
            samples_per_second=self._rate,
            loss=float(loss) if isinstance(loss, int | float) else None,
            last_checkpoint_step=None,
            last_checkpoint_time=None,
            last_save_seconds=None,
            last_stall_seconds=None,
            last_save_error=self._error,
            stop_requested=self._stop,
            total_steps=self._total_steps,
            first_step=self._first_step,
            last_step_time=self._last_step_time,
            stall_seconds_total=round(self._stall_total, 6),
            paces=tuple((s, round(p, 6)) for s, p in self._paces()) if self._paces else None,
        )
        body.update(self._checkpoint)
        return ProgressReport(**body).to_json()

    def _write(self, now: float) -> None:
        elapsed = now - self._window_start
        if self._samples and elapsed > 0:
            self._rate = round(self._samples / elapsed, 3)
            self._samples = 0
            self._window_start = now
        self._last_write = now
        try:
            body = self.snapshot()
            self._temp.write_text(json.dumps(body) + "\n", encoding="utf-8")
            os.replace(self._temp, self.path)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("could not write progress file %s: %s", self.path, exc)


def create_progress_reporter(
    environ: Mapping[str, str] | None = None, *, rank: int | None = None, interval: float = 1.0
) -> ProgressReporter:
    """A file reporter when ``TIDAL_PROGRESS_DIR`` is set, else the no-op twin.

    Args:
        environ: the environment to read (default: ``os.environ``).
        rank: this worker's rank (default: ``RANK``, else 0).
        interval: minimum seconds between writes.
    """
    env = os.environ if environ is None else environ
    directory = env.get(PROGRESS_DIR_ENV)
    if not directory:
        return NullProgressReporter()
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    with contextlib.suppress(ValueError):
        return FileProgressReporter(
            directory,
            rank=rank if rank is not None else int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            restart_count=int(restart) if restart and restart.isdigit() else None,
            interval=interval,
        )
    log.warning("RANK or WORLD_SIZE is not an integer; progress reporting is off")
    return NullProgressReporter()
