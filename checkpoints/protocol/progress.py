"""A worker's progress report, ``<TIDAL_PROGRESS_DIR>/rank-<RANK>.json``: the one model.

Written by each rank through :class:`checkpoints.progress.FileProgressReporter`
(a worker, with torch), read by its node's runner and agent daemon
(:mod:`agent.runner.status`, :mod:`agent.node.metrics`: no torch). Both go through
:class:`ProgressReport`, which imports nothing but the standard library.

The reader never trusts the file (the workers run the user's code): a field of
the wrong type reads as missing, a report of another format or version as no
report at all (:meth:`ProgressReport.from_json`). The fields are documented in
docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROGRESS_FORMAT = "tidal-progress"
PROGRESS_VERSION = 1
FILE_PREFIX = "rank-"
FILE_SUFFIX = ".json"


def file_name(rank: int) -> str:
    """``rank-<rank>.json``."""
    return f"{FILE_PREFIX}{int(rank)}{FILE_SUFFIX}"


def is_report_name(name: str) -> bool:
    """Whether a file in a progress directory is a rank's report."""
    return name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX)


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


#: The most ``(step, pace)`` pairs a report may carry.
MAX_PACES = 256


def _paces(value: Any) -> tuple[tuple[int, float], ...] | None:
    """``[[step, seconds], ...]``; None unless every pair is well formed."""
    if not isinstance(value, list | tuple) or len(value) > MAX_PACES:
        return None
    pairs = []
    for pair in value:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            return None
        step, pace = _integer(pair[0]), _number(pair[1])
        if step is None or pace is None or pace < 0:
            return None
        pairs.append((step, pace))
    return tuple(pairs)


@dataclass(frozen=True)
class ProgressReport:
    """One rank's report; every field may be missing (None)."""

    rank: int | None = None
    world_size: int | None = None
    pid: int | None = None
    #: How often the runner restarted the worker group (torch's restart count):
    #: reports of the newest count are the current workers'.
    restart_count: int | None = None
    time: float | None = None  # when the report was written (Unix time)
    first_step_time: float | None = None  # when this process completed its first step
    step: int | None = None  # completed steps
    samples_per_second: float | None = None
    loss: float | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None
    last_save_seconds: float | None = None
    last_stall_seconds: float | None = None
    last_save_error: str | None = None
    stop_requested: bool = False
    total_steps: int | None = None
    first_step: int | None = None  # the first step this process completed
    last_step_time: float | None = None
    stall_seconds_total: float | None = None
    #: The rank's own pace in recent steps, ``(step, seconds)`` oldest first: the
    #: time it computed (first forward to last gradient), not waited (checkpoints.pace).
    paces: tuple[tuple[int, float], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {"format": PROGRESS_FORMAT, "version": PROGRESS_VERSION,
                **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> ProgressReport | None:
        """The report in a parsed file; None if it is not a report of this format and
        version. A field of the wrong type reads as None."""
        if not isinstance(data, Mapping):
            return None
        if data.get("format") != PROGRESS_FORMAT or data.get("version") != PROGRESS_VERSION:
            return None
        values: dict[str, Any] = {}
        for spec in dataclasses.fields(cls):
            raw = data.get(spec.name)
            if spec.name == "stop_requested":
                values[spec.name] = raw is True
            elif spec.name == "last_save_error":
                values[spec.name] = _text(raw)
            elif spec.name == "paces":
                values[spec.name] = _paces(raw)
            elif spec.type in ("int | None",):
                values[spec.name] = _integer(raw)
            else:
                values[spec.name] = _number(raw)
        return cls(**values)

    @property
    def round(self) -> int:
        """The restart count, -1 when unknown (orders reports oldest round first)."""
        return -1 if self.restart_count is None else self.restart_count


#: Every key of the file, in order.
PROGRESS_FIELDS: tuple[str, ...] = (
    "format", "version", *(f.name for f in dataclasses.fields(ProgressReport)))
