"""An agent runs only what the coordinator assigned: the pure decision, and the
contract with the coordinator's own assignments (service.scheduler.assignment_for)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from agent.admission import AssignmentGate, decide, record_nodes
from rendezvous.errors import EtcdUnavailableError
from rendezvous.etcd import KeyValue
from rendezvous.keys import Keys
from rendezvous.records import Assignment
from service.api.models import JobRecord, JobSpec, ResizePolicy
from service.scheduler import assignment_for


def _record(**spec: Any) -> JobRecord:
    fields: dict[str, Any] = {
        "name": "train", "command": ["python", "train.py", "--lr", "0.1"],
        "env": {"SEED": "7"}, "min_nodes": 1, "max_nodes": 3, "nproc_per_node": 2,
        "max_restarts": 5, "grace_period_s": 12.0, **spec,
    }
    return JobRecord(
        job_id="train-1a2b", spec=JobSpec(**fields), cwd="/work/exp", checkpoint_path="/ck/run",
        nodes={"n1": 4, "n2": 6},
    )


def _raw(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()


@pytest.mark.parametrize(
    "policy",
    [None, ResizePolicy(lr_rule="sqrt"), ResizePolicy(global_batch_size=512, lr_rule="linear")],
)
def test_the_coordinators_own_assignment_is_run(policy: ResizePolicy | None) -> None:
    record = _record(resize_policy=policy)
    assert decide(assignment_for(record, 4), "n1", _raw(record)).run
    assert decide(assignment_for(record, 6), "n2", _raw(record)).run


def test_an_assignment_of_a_job_that_does_not_exist_is_ignored() -> None:
    record = _record()
    admission = decide(assignment_for(record, 4), "n1", None)
    assert not admission.run
    assert admission.reason == "job train-1a2b does not exist (no job record)"


def test_an_assignment_on_a_node_the_record_does_not_name_is_ignored() -> None:
    record = _record()
    admission = decide(assignment_for(record, 4), "n3", _raw(record))
    assert not admission.run
    assert "not assigned to node n3" in admission.reason


def test_an_assignment_of_another_generation_is_ignored() -> None:
    record = _record()
    admission = decide(assignment_for(record, 5), "n1", _raw(record))
    assert not admission.run
    assert admission.reason == "job train-1a2b's record gives node n1 generation 4, not 5"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"command": ["touch", "/tmp/pwned"]}, "command"),
        ({"cwd": "/etc"}, "cwd"),
        ({"env": {"SEED": "7", "LD_PRELOAD": "/tmp/evil.so"}}, "env"),
        ({"env": {"SEED": "8"}}, "env"),
        ({"env": {"SEED": "7", "TIDAL_ZYGOTE_PRELOAD": "evil"}}, "env"),
        ({"max_nodes": 4}, "max_nodes"),
        ({"nproc_per_node": 8}, "nproc_per_node"),
        ({"max_restarts": 100}, "max_restarts"),
        ({"checkpoint_dir": "/"}, "checkpoint_dir"),
        ({"grace_period_s": 1.0}, "grace_period_s"),
        ({"rdzv_conf": {"join_timeout": "1"}}, "rdzv_conf"),
        ({"zygote_preload": ["evil"]}, "zygote_preload"),
    ],
)
def test_an_assignment_that_differs_from_its_job_record_is_ignored(
    change: dict[str, Any], field: str
) -> None:
    record = _record()
    forged = assignment_for(record, 4).model_copy(update=change)
    admission = decide(forged, "n1", _raw(record))
    assert not admission.run
    assert admission.reason == (
        f"the assignment of job train-1a2b differs from its record in {field}"
    )
    assert "evil" not in admission.reason and "/tmp" not in admission.reason  # no values


def test_the_modules_a_zygote_preloads_are_the_records_own() -> None:
    """A forged assignment can neither add a module nor drop or reorder the record's."""
    record = _record(zygote_preload=["transformers", "lightning"])
    assignment = assignment_for(record, 4)
    assert assignment.zygote_preload == ["transformers", "lightning"]
    assert decide(assignment, "n1", _raw(record)).run
    for forged in (["transformers", "lightning", "evil"], ["transformers"],
                   ["lightning", "transformers"], []):
        admission = decide(assignment.model_copy(update={"zygote_preload": forged}), "n1",
                           _raw(record))
        assert admission.reason == (
            "the assignment of job train-1a2b differs from its record in zygote_preload"
        )


def test_a_resize_variable_not_from_the_policy_is_ignored() -> None:
    record = _record(resize_policy=ResizePolicy(lr_rule="sqrt"))
    forged = assignment_for(record, 4)
    forged = forged.model_copy(update={"env": {**forged.env, "TIDAL_RESIZE_POLICY": "linear"}})
    assert not decide(forged, "n1", _raw(record)).run


def test_a_record_that_is_not_a_job_record_or_another_jobs_is_ignored() -> None:
    record = _record()
    assignment = assignment_for(record, 4)
    assert "is not a job record" in decide(assignment, "n1", b"{not json").reason
    assert "is not a job record" in decide(assignment, "n1", b'{"job_id": "train-1a2b"}').reason
    other = record.model_copy(update={"job_id": "other-1"})
    assert decide(assignment, "n1", _raw(other)).reason == (
        "the record at job train-1a2b's key is job other-1's"
    )


def test_the_nodes_a_job_is_placed_on_come_from_its_record_only() -> None:
    record = _record()
    assert record_nodes("train-1a2b", _raw(record)) == {"n1": 4, "n2": 6}
    assert record_nodes("train-1a2b", None) == {}
    assert record_nodes("train-1a2b", b"{not json") == {}
    assert record_nodes("other-1", _raw(record)) == {}  # another job's record at this key


class _Client:
    """Just enough of EtcdClient for the gate: ``keys`` and ``get``, counted."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.keys = Keys("/t")
        self.values = values
        self.gets = 0
        self.fail = False

    def get(self, key: str) -> KeyValue | None:
        self.gets += 1
        if self.fail:
            raise EtcdUnavailableError("etcd did not answer")
        value = self.values.get(key)
        return None if value is None else KeyValue(key, value, 1, 1, 1, 0)


def _kv(assignment: Assignment, revision: int) -> KeyValue:
    return KeyValue("/t/assignments/n1/train-1a2b", assignment.model_dump_json().encode(),
                    1, revision, 1, 0)


def test_the_gate_asks_once_per_admitted_revision_and_again_with_a_growing_pause() -> None:
    record = _record()
    assignment = assignment_for(record, 4)
    client = _Client({})
    now = [100.0]
    gate = AssignmentGate(client, "n1", clock=lambda: now[0])  # type: ignore[arg-type]
    key = "/t/assignments/n1/train-1a2b"
    assert not gate.admitted(key, _kv(assignment, 10), assignment)
    assert not gate.admitted(key, _kv(assignment, 10), assignment)
    assert client.gets == 1  # within the first pause: not asked again
    pauses = []
    for _ in range(8):
        before = client.gets
        while client.gets == before:
            now[0] += 0.05
            gate.admitted(key, _kv(assignment, 10), assignment)
        pauses.append(now[0])
    gaps = [b - a for a, b in itertools.pairwise(pauses)]  # to within the 0.05 s steps
    assert all(b > a - 0.06 for a, b in itertools.pairwise(gaps)), gaps  # growing...
    assert gaps[0] < 1 and 4.9 < gaps[-1] < 5.1, gaps  # ...up to 5 s
    client.values["/t/jobs/train-1a2b"] = _raw(record)  # the record arrives
    now[0] += 5.1
    assert gate.admitted(key, _kv(assignment, 10), assignment)
    asked = client.gets
    now[0] += 1000
    assert gate.admitted(key, _kv(assignment, 10), assignment)
    assert client.gets == asked  # an admitted revision is not asked again
    # A new revision of the key is judged afresh.
    forged = assignment.model_copy(update={"command": ["touch", "/tmp/pwned"]})
    assert not gate.admitted(key, _kv(forged, 11), forged)


def test_the_gate_treats_an_etcd_error_as_not_yet() -> None:
    record = _record()
    assignment = assignment_for(record, 4)
    client = _Client({"/t/jobs/train-1a2b": _raw(record)})
    client.fail = True
    gate = AssignmentGate(client, "n1", clock=lambda: 0.0)  # type: ignore[arg-type]
    key = "/t/assignments/n1/train-1a2b"
    assert not gate.admitted(key, _kv(assignment, 10), assignment)
    client.fail = False
    assert gate.admitted(key, _kv(assignment, 10), assignment)  # asked again at once
    gate.forget_except({})
    assert gate.admitted(key, _kv(assignment, 10), assignment)
    assert client.gets == 3
