"""The chaos soak's pure parts: which fault comes next, and the counts it reports."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.chaos.plan import FaultKind, fault_plan
from tests.chaos.report import Fault, Tally, format_counts


def test_the_plan_hits_every_kind_once_before_drawing_at_random() -> None:
    kinds = list(FaultKind)
    first = list(itertools.islice(fault_plan(random.Random(7), kinds), len(kinds)))
    assert sorted(first) == sorted(kinds)


def test_the_same_seed_gives_the_same_faults() -> None:
    def plan(seed: int) -> list[FaultKind]:
        return list(itertools.islice(fault_plan(random.Random(seed), list(FaultKind)), 40))

    assert plan(3) == plan(3)
    assert plan(3) != plan(4)


def test_the_plan_draws_only_the_kinds_it_is_given() -> None:
    kinds = [FaultKind.KILL_WORKER, FaultKind.STOP]
    assert set(itertools.islice(fault_plan(random.Random(1), kinds), 50)) == set(kinds)
    with pytest.raises(ValueError, match="at least one"):
        next(fault_plan(random.Random(1), []))


def test_steps_redone_count_only_faults_that_restarted_the_workers() -> None:
    tally = Tally(seed=1, seconds=10, total_steps=100, final_step=100, succeeded=True)
    tally.faults = [
        Fault(FaultKind.KILL_WORKER, "w", 1.0, step=21, checkpoint_step=20, restarted=True,
              recovery_s=3.0),
        Fault(FaultKind.KILL_ETCD, "e", 5.0, step=40, checkpoint_step=36, restarted=False,
              recovery_s=1.0),
    ]
    counts = tally.counts()
    assert counts["faults_by_kind"] == {"kill_etcd": 1, "kill_worker": 1}
    assert counts["steps_redone"] == 1
    assert counts["recoveries"] == 2
    assert counts["steps_lost"] == 0
    assert "faults injected:   2" in format_counts(counts)
