"""The straggler decision (service.scheduler.stragglers): who is slow, and what happens to it."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.models import StragglerPolicy
from service.scheduler.stragglers import cooling_down, find_stragglers, pace_ratios

EVICT = StragglerPolicy(mode="evict")
REPORT = StragglerPolicy(mode="report")


def steady(nodes: dict[str, float], steps: int = 20, start: int = 0) -> dict[str, dict[int, float]]:
    return {node: {s: pace for s in range(start, start + steps)} for node, pace in nodes.items()}


def test_a_node_at_half_speed_is_evicted_and_the_others_are_not():
    paces = steady({"a": 1.0, "b": 1.0, "c": 2.0})
    found = find_stragglers(paces, EVICT, members=3, min_nodes=2)
    assert [(s.node_id, s.action) for s in found] == [("c", "evict")]
    assert found[0].ratio == 2.0
    assert "2.00x the median" in found[0].reason


def test_a_job_at_its_minimum_keeps_the_straggler_and_says_why():
    found = find_stragglers(steady({"a": 1.0, "b": 2.0}), EVICT, members=2, min_nodes=2)
    assert [(s.node_id, s.action) for s in found] == [("b", "report")]
    assert "minimum of 2 nodes" in found[0].reason


def test_two_stragglers_and_room_for_one_eviction_evict_the_slowest():
    paces = steady({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.6, "e": 2.5})
    found = find_stragglers(paces, EVICT, members=5, min_nodes=4)
    assert [(s.node_id, s.action) for s in found] == [("e", "evict"), ("d", "report")]


def test_report_never_evicts_and_off_never_looks():
    paces = steady({"a": 1.0, "b": 1.0, "c": 3.0})
    assert [s.action for s in find_stragglers(paces, REPORT, members=3, min_nodes=1)] == ["report"]
    assert find_stragglers(paces, StragglerPolicy(mode="off"), members=3, min_nodes=1) == []


def test_a_window_not_yet_full_decides_nothing():
    paces = steady({"a": 1.0, "b": 1.0, "c": 3.0}, steps=19)
    assert find_stragglers(paces, EVICT, members=3, min_nodes=1) == []


def test_only_steps_every_node_reported_count():
    paces = steady({"a": 1.0, "b": 1.0}, steps=40)
    paces["c"] = {s: 3.0 for s in range(30, 40)}  # joined late: 10 common steps
    assert pace_ratios(paces, 20) == {}
    assert pace_ratios(paces, 10)["c"] == 3.0


def test_a_whole_job_that_is_slow_has_no_straggler():
    assert find_stragglers(steady({"a": 5.0, "b": 5.0, "c": 5.0}), EVICT,
                           members=3, min_nodes=1) == []


def test_single_spikes_are_not_a_straggler():
    paces = steady({"a": 1.0, "b": 1.0, "c": 1.0})
    for step in (2, 9, 15):  # three steps in twenty at ten times the pace
        paces["c"][step] = 10.0
    assert find_stragglers(paces, EVICT, members=3, min_nodes=1) == []


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nodes=st.integers(2, 12),
       noise=st.floats(0.0, 0.1), spikes=st.integers(0, 5))
def test_a_noisy_but_not_slower_node_is_never_evicted(seed, nodes, noise, spikes):
    """Nodes of the same pace with noise (up to 10%) and spikes (up to 5 steps in any 20,
    each 2 to 10 times as long), one of them twice as noisy: none is a straggler."""
    rng = random.Random(seed)

    def node_paces(width: float) -> dict[int, float]:
        spiky = set(rng.sample(range(40), spikes))
        return {s: (1.0 + rng.uniform(-width, width)) * (rng.uniform(2, 10) if s in spiky else 1.0)
                for s in range(40)}

    paces = {f"n{i}": node_paces(noise) for i in range(1, nodes)}
    paces["n0"] = node_paces(2 * noise)
    assert find_stragglers(paces, EVICT, members=nodes, min_nodes=1) == []


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nodes=st.integers(3, 12),
       slowdown=st.floats(1.5, 4.0), noise=st.floats(0.0, 0.1))
def test_a_node_persistently_slower_by_more_than_the_factor_is_found(seed, nodes, slowdown, noise):
    rng = random.Random(seed)
    paces = {f"n{i}": {s: 1.0 + rng.uniform(-noise, noise) for s in range(30)}
             for i in range(nodes)}
    paces["slow"] = {s: slowdown * (1.0 + rng.uniform(-noise, noise)) for s in range(30)}
    found = find_stragglers(paces, EVICT, members=nodes + 1, min_nodes=1)
    assert [(s.node_id, s.action) for s in found] == [("slow", "evict")]


def test_a_slow_node_is_kept_out_of_placements_for_the_cool_down_only():
    marked = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert cooling_down(marked, now=marked + timedelta(seconds=599), cooldown_s=600)
    assert not cooling_down(marked, now=marked + timedelta(seconds=600), cooldown_s=600)
    assert not cooling_down(None, now=marked, cooldown_s=600)
