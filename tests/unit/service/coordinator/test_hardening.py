"""No job can wedge scheduling: size limits, split writes, cut passes, giving up, training.

Pure functions only (the scheduler, the store's operation builders, the spec's
limits); tests/integration/service/coordinator/test_hardening.py runs the same against
real etcd and a real coordinator.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rendezvous.election import NotLeaderError
from rendezvous.errors import EtcdError, EtcdNoSpaceError, EtcdUnavailableError
from rendezvous.etcd import Delete, Put
from rendezvous.keys import Keys
from service.api.models import (
    MAX_COMMAND_BYTES,
    MAX_ENV_BYTES,
    MAX_SPEC_BYTES,
    EventReason,
    ExitReason,
    JobEvent,
    JobPhase,
    JobSpec,
    ScaleRequest,
    check_storable,
)
from service.coordinator.metrics import CoordinatorMetrics
from service.coordinator.reconciler import _is_job_error
from service.coordinator.store import MAX_TXN_BYTES, MAX_TXN_OPS, job_ops, split_ops
from service.scheduler import (
    MAX_NAMES_IN_MESSAGE,
    abandon,
    names,
    note_write_failure,
    plan,
)
from tests.unit.service.sim import Sim, apply, make_job, make_node

KEYS = Keys("/t")


def spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "train", "command": ["python", "t.py"], **fields})


def condition(sim: Sim, job_id: str, type_: str) -> tuple[bool, str]:
    [cond] = [c for c in sim.job(job_id).conditions if c.type == type_]
    return cond.status, cond.reason


# the spec's limits -------------------------------------------------------------------------


def test_the_issues_example_env_of_125_values_of_8000_characters_is_refused_naming_env() -> None:
    big = spec(env={f"V{i}": "x" * 8000 for i in range(125)})  # each value is within limits
    with pytest.raises(ValueError, match=rf"env: .* at most {MAX_ENV_BYTES} are allowed"):
        check_storable(big)


def test_a_long_command_is_refused_naming_the_command() -> None:
    long = spec(command=["python", *(["a" * 4000] * 40)])
    with pytest.raises(ValueError, match=rf"command: .* at most {MAX_COMMAND_BYTES}"):
        check_storable(long)


def test_a_spec_within_each_limit_but_too_big_as_json_is_refused() -> None:
    # A control character takes six bytes in JSON ("\u0001").
    escaped = spec(env={f"V{i}": "\x01" * 8000 for i in range(15)})
    with pytest.raises(ValueError, match=rf"spec: .* at most {MAX_SPEC_BYTES}"):
        check_storable(escaped)


def test_a_spec_at_the_limits_is_storable() -> None:
    check_storable(spec(env={f"V{i}": "x" * 8000 for i in range(15)}))


@pytest.mark.parametrize("value", ["2", True, 2.0, "two"])
@pytest.mark.parametrize("field", ["min_nodes", "max_nodes", "nproc_per_node", "priority"])
def test_numbers_are_strict_a_string_or_boolean_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        spec(**{field: value})
    assert field in str(info.value)


def test_scale_requests_are_strict_too() -> None:
    with pytest.raises(ValidationError, match="max_nodes"):
        ScaleRequest.model_validate({"max_nodes": "3"})
    assert ScaleRequest.model_validate({"max_nodes": 3}).max_nodes == 3


def test_a_grace_period_may_be_an_integer() -> None:
    assert spec(grace_period_s=5).grace_period_s == 5.0


# splitting writes --------------------------------------------------------------------------


def test_operations_are_cut_at_the_operation_limit_in_order() -> None:
    ops = [Delete(f"/k/{i}") for i in range(250)]
    groups = split_ops(ops)
    assert [len(g) for g in groups] == [MAX_TXN_OPS, MAX_TXN_OPS, 50]
    assert [op for g in groups for op in g] == ops


def test_operations_are_cut_at_the_byte_limit_and_a_huge_one_goes_alone() -> None:
    ops = [Put(f"/k/{i}", b"x" * 400_000) for i in range(5)] + [Put("/big", b"y" * 2_000_000)]
    groups = split_ops(ops)
    assert [len(g) for g in groups] == [2, 2, 1, 1]
    for group in groups[:-1]:
        assert sum(len(op.value) for op in group if isinstance(op, Put)) <= MAX_TXN_BYTES


def _placed(job_id: str, *nodes: str) -> Sim:
    sim = Sim()
    sim.join(*(make_node(n) for n in nodes))
    sim.submit(make_job(job_id, min_nodes=len(nodes), max_nodes=len(nodes)))
    return sim


def test_a_change_writes_its_record_first_then_deletes_then_new_assignments() -> None:
    sim = Sim()
    sim.join(make_node("a"), make_node("b"), make_node("c"))
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    sim.settle()
    [gone] = sorted(sim.placed("j"))[:1]
    sim.kill(gone)
    [change] = sim.plan()
    assert change.delete == [gone] and len(change.put) == 1
    ops = job_ops(KEYS, change.record, put=change.put, delete=change.delete,
                  events=change.events)
    kinds = [(type(op).__name__, op.key.split("/")[2]) for op in ops]
    assert kinds == [*[("Put", "events")] * len(change.events), ("Put", "jobs"),
                     ("Delete", "assignments"), ("Put", "assignments")]


def test_a_job_that_ends_writes_its_record_first_then_releases_its_nodes() -> None:
    sim = _placed("j", "a", "b")
    sim.settle()
    sim.cancel("j")
    [change] = sim.plan()
    assert change.record.phase == JobPhase.CANCELLED
    ops = job_ops(KEYS, change.record, put=change.put, delete=change.delete,
                  events=change.events)
    assert ops[len(change.events)].key == KEYS.job("j")
    assert all(isinstance(op, Delete) for op in ops[-2:])


def test_a_pass_cut_after_some_assignments_converges_without_reusing_a_generation() -> None:
    nodes = [f"n{i:03d}" for i in range(300)]
    sim = _placed("j", *nodes)
    [change] = sim.plan()
    assert len(change.put) == 300
    # The record and the first 100 assignments were written, then the leader died.
    first = dict(sorted(change.put.items())[:MAX_TXN_OPS])
    sim.view = apply(sim.view, [replace(change, put=first)])
    assert sim.job("j").next_generation > max(a.generation for a in change.put.values())
    [again] = sim.plan()
    assert set(again.put) == set(nodes) - set(first)
    given = {a.generation for a in change.put.values()}
    assert not given & {a.generation for a in again.put.values()}
    sim.view = apply(sim.view, [again])
    sim.settle()
    assert sim.placed("j") == set(nodes) and sim.phase("j") == JobPhase.RUNNING


def test_generations_written_by_a_cut_pass_are_never_handed_out_again() -> None:
    """Assignments written without their record (by an older order, or by hand)."""
    sim = _placed("j", "a", "b")
    [change] = sim.plan()
    early = {n: a for n, a in change.put.items() if n == "a"}
    sim.view = apply(sim.view, [replace(change, put=early, events=[], record=sim.job("j"))])
    [again] = sim.plan()
    assert again.put["b"].generation > early["a"].generation
    assert again.record.next_generation > again.put["b"].generation
    sim.kill("a")  # a's assignment is deleted: the record still counts its generation
    sim.view = apply(sim.view, [again])
    sim.step()
    assert sim.job("j").next_generation > early["a"].generation


def test_a_finished_job_cut_after_its_record_has_its_assignments_deleted_next_pass() -> None:
    sim = _placed("j", "a", "b")
    sim.settle()
    sim.cancel("j")
    [change] = sim.plan()
    sim.view = apply(sim.view, [replace(change, delete=[])])  # only the record got through
    [again] = sim.plan()
    assert sorted(again.delete) == ["a", "b"] and again.record.phase == JobPhase.CANCELLED


def test_messages_name_a_bounded_number_of_nodes() -> None:
    nodes = [f"node-with-a-long-name-{'x' * 30}-{i:04d}" for i in range(400)]
    text = names(nodes)
    assert text.endswith(f"and {400 - MAX_NAMES_IN_MESSAGE} more")
    sim = _placed("j", *nodes)  # a JobEvent's message is at most 4,096 characters
    [change] = sim.plan()
    assert all(len(e.message) < 4096 for e in change.events)
    assert all(len(c.message) < 4096 for c in change.record.conditions)


# a job whose writes etcd refuses -----------------------------------------------------------


def test_a_refused_write_is_noted_on_the_job_with_an_event_and_its_condition() -> None:
    sim = _placed("j", "a")
    change = note_write_failure(sim.view, "j", "etcdserver: request is too large", 1, 3,
                                sim.clock)
    assert change.put == {} and change.delete == []
    [event] = change.events
    assert event.reason == EventReason.WRITE_FAILED and "request is too large" in event.message
    sim.view = apply(sim.view, [change])
    assert condition(sim, "j", "Scheduled") == (False, EventReason.WRITE_FAILED.value)


def test_an_abandoned_job_fails_naming_the_refusal_and_releases_its_nodes() -> None:
    sim = _placed("j", "a", "b")
    sim.settle()
    change = abandon(sim.view, "j", "etcdserver: too many operations in txn request", sim.clock)
    assert sorted(change.delete) == ["a", "b"] and change.put == {}
    record = change.record
    assert record.phase == JobPhase.FAILED and record.exit_reason == ExitReason.UNSCHEDULABLE
    assert record.nodes == {} and record.finished_at == sim.clock
    assert "too many operations" in change.events[-1].message
    assert change.events[-1].reason == EventReason.WRITE_FAILED
    sim.view = apply(sim.view, [change])
    assert condition(sim, "j", "Finished") == (True, EventReason.WRITE_FAILED.value)
    assert plan(sim.view, sim.clock) == []


def test_abandoning_a_job_that_already_ended_only_deletes_its_leftovers() -> None:
    sim = _placed("j", "a")
    sim.settle()
    sim.cancel("j")
    [change] = sim.plan()
    sim.view = apply(sim.view, [replace(change, delete=[])])
    again = abandon(sim.view, "j", "refused", sim.clock)
    assert again.delete == ["a"] and again.events == []
    assert again.record.phase == JobPhase.CANCELLED


def test_a_long_error_is_clipped_in_what_is_stored() -> None:
    sim = _placed("j", "a")
    change = abandon(sim.view, "j", "e" * 100_000, sim.clock)
    JobEvent.model_validate(change.events[-1].model_dump())  # within the event's limit
    assert len(change.record.model_dump_json()) < 10_000


# when training started ---------------------------------------------------------------------


def test_training_turns_true_at_the_first_step_of_the_current_generation() -> None:
    sim = _placed("j", "a", "b")
    sim.step()
    assert condition(sim, "j", "Training") == (False, EventReason.WAITING_FOR_FIRST_STEP.value)
    sim.settle()
    assert sim.phase("j") == JobPhase.RUNNING
    assert condition(sim, "j", "Training")[0] is False  # running, but no step yet
    sim.report("j", "a", last_step=0)
    sim.step()
    assert condition(sim, "j", "Training") == (True, EventReason.TRAINING_STARTED.value)
    [cond] = [c for c in sim.job("j").conditions if c.type == "Training"]
    assert "step 0" in cond.message
    assert sim.step() == []  # later steps change nothing


def test_a_step_at_the_old_world_size_does_not_count_after_a_rescale() -> None:
    sim = Sim()
    sim.join(make_node("a"), make_node("b"))
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    sim.settle()
    sim.report("j", "a", last_step=5)
    sim.report("j", "b", last_step=5)
    sim.step()
    assert condition(sim, "j", "Training")[0] is True
    sim.kill("b")
    sim.step()  # the job shrinks: a's runner restarts its workers at world size 1
    sim.report("j", "a", world_size=2, last_step=5)  # still the workers of size 2
    sim.step()
    assert condition(sim, "j", "Training")[0] is False
    sim.report("j", "a", world_size=1, last_step=6)
    sim.step()
    assert condition(sim, "j", "Training")[0] is True


def test_the_first_step_is_recorded_once_and_observed_once_by_queue() -> None:
    sim = Sim()
    sim.join(make_node("a"), make_node("b"))
    sim.submit(make_job("j", min_nodes=1, max_nodes=2))
    sim.settle()
    assert sim.job("j").first_step_at is None
    sim.report("j", "a", last_step=0)
    sim.report("j", "b", last_step=0)
    sim.step()
    first = sim.job("j").first_step_at
    assert first is not None and first >= sim.job("j").created_at
    metrics = CoordinatorMetrics(CollectorRegistry())
    metrics.observe_first_step(sim.job("j"))
    count = metrics.registry.get_sample_value(
        "tidal_coordinator_queue_first_step_seconds_count", {"queue": "default"})
    assert count == 1
    sim.kill("b")  # a rescale: Training turns false, then true again
    sim.step()
    sim.report("j", "a", world_size=1, last_step=7)
    sim.step()
    assert condition(sim, "j", "Training")[0] is True
    assert sim.job("j").first_step_at == first  # the first step of the job's life, kept


# which failures are one job's ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "one_job"),
    [
        (EtcdError("etcd at x: transaction failed (INVALID_ARGUMENT): etcdserver: request is "
                   "too large"), True),
        (EtcdError("etcdserver: too many operations in txn request"), True),
        (EtcdError("etcdserver: duplicate key given in txn request"), True),
        (EtcdError("grpc: received message larger than max (2000000 vs. 1572864)"), True),
        (ValueError("a record that cannot be built"), True),
        (EtcdError("etcdserver: too many requests"), False),  # etcd overloaded: all jobs
        (EtcdUnavailableError("did not answer within 5 s"), False),
        (EtcdNoSpaceError("etcdserver: mvcc: database space exceeded"), False),
        (NotLeaderError("deposed: request is too large"), False),
    ],
)
def test_only_a_refusal_of_the_request_itself_is_one_jobs_failure(
    exc: Exception, one_job: bool
) -> None:
    assert _is_job_error(exc) is one_job
