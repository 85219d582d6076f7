"""New bounds written in place (agent.bounds): what a runner and its daemon take over."""

from __future__ import annotations

import pytest

from agent.bounds import bounds_at, rewritten_bounds, take_over
from rendezvous.records import Assignment

RUNNING = Assignment(job_id="j", generation=3, command=["python", "train.py"],
                     env={"A": "1"}, min_nodes=2, max_nodes=2, max_restarts=3)


def test_new_bounds_at_the_same_generation_are_a_rewrite_in_place() -> None:
    written = RUNNING.model_copy(update={"min_nodes": 1, "max_nodes": 4})
    assert rewritten_bounds(RUNNING, written) == (1, 4)


def test_the_same_assignment_written_again_is_no_rewrite() -> None:
    assert rewritten_bounds(RUNNING, RUNNING.model_copy()) is None


@pytest.mark.parametrize("other", [
    {"generation": 4},  # a new generation: the daemon stops the runner
    {"command": ["python", "evil.py"]},
    {"env": {"A": "2"}},
    {"max_restarts": 9},
    {"nproc_per_node": 2},
])
def test_bounds_that_come_with_any_other_change_are_not_taken_over(
    other: dict[str, object]
) -> None:
    written = RUNNING.model_copy(update={"max_nodes": 4, **other})
    assert rewritten_bounds(RUNNING, written) is None
    assert take_over(RUNNING, written, lambda: True) is RUNNING


def test_the_daemon_takes_the_bounds_over_only_once_the_record_confirms_them() -> None:
    written = RUNNING.model_copy(update={"min_nodes": 1, "max_nodes": 4})
    assert take_over(RUNNING, written, lambda: False) is RUNNING
    assert take_over(RUNNING, written, lambda: True) == written


def test_the_record_is_not_asked_about_what_is_no_rewrite() -> None:
    def ask() -> bool:
        raise AssertionError("asked")

    assert take_over(RUNNING, RUNNING, ask) is RUNNING


def test_a_runner_reads_bounds_only_at_its_own_generation() -> None:
    value = RUNNING.model_copy(update={"max_nodes": 5}).model_dump_json().encode()
    assert bounds_at(value, 3) == (2, 5)
    assert bounds_at(value, 2) is None
    assert bounds_at(b"{not json", 3) is None
    assert bounds_at(b'{"job_id": "j"}', 3) is None
