"""What a chaos soak did, counted: faults by kind, recoveries, steps redone, nothing lost.

The soak (tests/chaos/test_chaos.py) fills a :class:`Tally`, prints it and saves
it as JSON (to ``TIDAL_CHAOS_REPORT`` if set); ``python -m tests.chaos.report
FILE`` prints a saved one again.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.plan import FaultKind


@dataclass
class Fault:
    """One injected fault and what it led to."""

    kind: FaultKind
    target: str  # e.g. "agent a2", "coordinator c1", "etcd m3"
    at_s: float  # seconds since the soak began
    step: int  # the job's last step when it was injected
    checkpoint_step: int  # the job's newest checkpoint then
    restarted: bool = False  # the job's workers restarted because of it
    recovery_s: float | None = None  # until the job made a step past ``step``
    events: list[str] = field(default_factory=list)  # job events it produced (reasons)
    accounted: str = ""  # how the soak checked it left its mark
    job_restarts: dict[str, int] = field(default_factory=dict)  # the job's, once recovered

    @property
    def steps_redone(self) -> int:
        """Steps trained again: those after the newest checkpoint, when the workers restarted."""
        return max(0, self.step - self.checkpoint_step) if self.restarted else 0


@dataclass
class Tally:
    """What one soak did: its seed, its faults, and how the job ended."""

    seed: int
    seconds: float
    total_steps: int
    faults: list[Fault] = field(default_factory=list)
    final_step: int | None = None
    succeeded: bool = False
    max_abs_diff: float | None = None  # final parameters against the uninterrupted run
    restarts: dict[str, int] = field(default_factory=dict)  # the job's, by reason
    leftover_processes: int | None = None

    def counts(self) -> dict[str, Any]:
        by_kind = Counter(f.kind.value for f in self.faults)
        recovered = [f for f in self.faults if f.recovery_s is not None]
        times = sorted(f.recovery_s for f in recovered if f.recovery_s is not None)
        return {
            "seed": self.seed,
            "chaos_seconds": self.seconds,
            "faults": len(self.faults),
            "faults_by_kind": dict(sorted(by_kind.items())),
            "recoveries": len(recovered),
            "recovery_s_median": times[len(times) // 2] if times else None,
            "recovery_s_max": times[-1] if times else None,
            "worker_restarts": sum(f.restarted for f in self.faults),
            "steps_redone": sum(f.steps_redone for f in self.faults),
            "job_restarts_by_reason": dict(sorted(self.restarts.items())),
            "final_step": self.final_step,
            "total_steps": self.total_steps,
            "succeeded": self.succeeded,
            "max_abs_param_diff": self.max_abs_diff,
            "steps_lost": (None if self.final_step is None
                           else max(0, self.total_steps - self.final_step)),
            "leftover_processes": self.leftover_processes,
        }

    def save(self, path: Path) -> None:
        data = {"counts": self.counts(), "faults": [
            {**asdict(f), "kind": f.kind.value, "steps_redone": f.steps_redone}
            for f in self.faults
        ]}
        path.write_text(json.dumps(data, indent=2) + "\n")


def format_counts(counts: dict[str, Any]) -> str:
    """The counts as lines a person reads (and docs/benchmarks.md quotes)."""
    kinds = ", ".join(f"{k} {n}" for k, n in counts["faults_by_kind"].items()) or "none"
    restarts = ", ".join(f"{k} {n}" for k, n in counts["job_restarts_by_reason"].items()) or "0"
    diff = counts["max_abs_param_diff"]

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    return "\n".join([
        f"chaos soak, seed {counts['seed']}, {counts['chaos_seconds']:g} s of faults",
        f"  faults injected:   {counts['faults']} ({kinds})",
        f"  recoveries:        {counts['recoveries']} (a step past the fault's; median "
        f"{seconds(counts['recovery_s_median'])}, max {seconds(counts['recovery_s_max'])})",
        f"  worker restarts:   {counts['worker_restarts']} faults restarted the workers; "
        f"job restarts by reason: {restarts}",
        f"  steps redone:      {counts['steps_redone']} (step at the fault minus the newest "
        "checkpoint, for faults that restarted the workers)",
        f"  nothing lost:      job {'SUCCEEDED' if counts['succeeded'] else 'did NOT succeed'} "
        f"at step {counts['final_step']} of {counts['total_steps']}; max |param - reference| "
        f"{'-' if diff is None else f'{diff:.3g}'}; processes left {counts['leftover_processes']}",
    ])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.chaos.report REPORT.json", file=sys.stderr)
        return 2
    print(format_counts(json.loads(Path(argv[0]).read_text())["counts"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
