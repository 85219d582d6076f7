"""The GPU check's results: one outcome per part and per check within it, as JSON and markdown.

Each part (and each named check inside a part) ends ``ok``, ``failed`` with the
reason or ``skipped`` with why; figures are numbers with a unit in their name
(``step_s``, ``steps_lost``). The JSON (``gpu-check.json``) is what a later session
reads the figures from; the markdown (``gpu-check.md``) is what a person reads.
Both are written after every part, so a run cut short still leaves what it had.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any

JSON_NAME = "gpu-check.json"
MARKDOWN_NAME = "gpu-check.md"
FORMAT_VERSION = 1


class Outcome(str, Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


class PartSkipped(Exception):
    """Raised inside a part to end it as skipped, with the reason."""


@dataclasses.dataclass
class Check:
    """One named check within a part."""

    name: str
    outcome: Outcome
    detail: str = ""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PartResult:
    """One part of the check; its outcome is the worst of its checks unless set."""

    number: int
    title: str
    budget_s: float
    outcome: Outcome = Outcome.SKIPPED
    reason: str = "not run"
    seconds: float = 0.0
    checks: list[Check] = dataclasses.field(default_factory=list)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ok(self, name: str, detail: str = "", **figures: Any) -> Check:
        return self._add(Check(name, Outcome.OK, detail, figures))

    def failed(self, name: str, detail: str, **figures: Any) -> Check:
        return self._add(Check(name, Outcome.FAILED, detail, figures))

    def skipped(self, name: str, why: str, **figures: Any) -> Check:
        return self._add(Check(name, Outcome.SKIPPED, why, figures))

    def _add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def settle(self) -> None:
        """The part's outcome from its checks: failed if one failed, ok if one passed."""
        failed = [c for c in self.checks if c.outcome is Outcome.FAILED]
        passed = [c for c in self.checks if c.outcome is Outcome.OK]
        if failed:
            self.outcome = Outcome.FAILED
            self.reason = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        elif passed:
            self.outcome = Outcome.OK
            skipped = [c.name for c in self.checks if c.outcome is Outcome.SKIPPED]
            self.reason = f"skipped: {', '.join(skipped)}" if skipped else ""
        else:
            self.outcome = Outcome.SKIPPED
            self.reason = "; ".join(c.detail for c in self.checks) or self.reason


@dataclasses.dataclass
class Report:
    """The whole run: where, on what, each part."""

    dry_run: bool
    started_at: float = dataclasses.field(default_factory=time.time)
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    install: PartResult | None = None
    parts: list[PartResult] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        def part(p: PartResult) -> dict[str, Any]:
            body = dataclasses.asdict(p)
            body["outcome"] = p.outcome.value
            body["checks"] = [{**dataclasses.asdict(c), "outcome": c.outcome.value}
                              for c in p.checks]
            return body

        return {
            "format": "tidal-gpu-check",
            "version": FORMAT_VERSION,
            "dry_run": self.dry_run,
            "started_at": self.started_at,
            "wall_s": round(self.wall_s, 1),
            "environment": self.environment,
            "install": part(self.install) if self.install else None,
            "parts": [part(p) for p in self.parts],
        }

    def markdown(self, *, with_checks: bool = True) -> str:
        """The table of parts, then (``with_checks``) each part's checks."""
        env = self.environment
        title = "# tidal GPU check" + (" (dry run: no CUDA)" if self.dry_run else "")
        lines = [
            title,
            "",
            f"- device: {env.get('gpu_names') or 'none'}; torch {env.get('torch', '?')}, "
            f"CUDA {env.get('cuda') or '-'}, Python {env.get('python', '?')}",
            f"- wall time: {self.wall_s:.0f} s",
            *(f"- {key}: {_cell(str(env[key]))}" for key in ("error", "warning",
                                                           "stray_processes_killed") if key in env),
            "",
            "| part | outcome | time (s) | figures | reason |",
            "|---|---|---|---|---|",
        ]
        rows = ([self.install] if self.install else []) + self.parts
        for p in rows:
            lines.append(f"| {p.number}. {p.title} | {p.outcome.value} | {p.seconds:.0f} "
                         f"| {_figures(p.figures)} | {_cell(p.reason)} |")
        if not with_checks:
            return "\n".join(lines) + "\n"
        for p in rows:
            if not p.checks:
                continue
            lines += ["", f"## {p.number}. {p.title}", "", "| check | outcome | figures | detail |",
                      "|---|---|---|---|"]
            for c in p.checks:
                lines.append(f"| {_cell(c.name)} | {c.outcome.value} | {_figures(c.figures)} "
                             f"| {_cell(c.detail)} |")
        return "\n".join(lines) + "\n"

    def write(self, out: Path) -> None:
        """Write both files atomically (a reader never sees half of one)."""
        out.mkdir(parents=True, exist_ok=True)
        _write_atomically(out / JSON_NAME, json.dumps(self.to_json(), indent=2) + "\n")
        _write_atomically(out / MARKDOWN_NAME, self.markdown())


def _figures(figures: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    return _cell(", ".join(f"{k}={show(v)}" for k, v in figures.items()))


def _cell(text: str) -> str:
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= 400 else flat[:397] + "..."


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
