"""What a job spec accepts, and how a job's phase may move."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rendezvous.records import MODULE_NAME_PATTERN
from service.api.models import (
    TRANSITIONS,
    IllegalTransitionError,
    JobPhase,
    JobRecord,
    JobSpec,
    ResizePolicy,
    ScaleRequest,
)
from service.api.queues import QueuePatch
from tests.unit.service.sim import T0

TERMINAL = [JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED]
LIVE = [JobPhase.PENDING, JobPhase.RUNNING, JobPhase.RESCALING]


def spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "train", "command": ["python", "t.py"], **fields})


def refused(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        spec(**fields)
    return str(info.value)


# JobSpec ---------------------------------------------------------------------------------


def test_a_minimal_spec_runs_on_one_node_with_one_process() -> None:
    s = spec()
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node, s.priority) == (1, 1, 1, 0)


def test_a_minimum_above_the_maximum_is_refused_naming_both() -> None:
    assert "min_nodes (4) is greater than max_nodes (2)" in refused(min_nodes=4, max_nodes=2)


@pytest.mark.parametrize("field", ["min_nodes", "max_nodes", "nproc_per_node"])
@pytest.mark.parametrize("value", [0, -1, 10**9])
def test_counts_out_of_range_are_refused(field: str, value: int) -> None:
    assert field in refused(**{field: value})


@pytest.mark.parametrize("command", [[], ["a\0b"], "python t.py"])
def test_a_command_is_a_non_empty_list_of_arguments_without_nul(command: object) -> None:
    assert "command" in refused(command=command)


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "TIDAL_X",
                                  "TORCHELASTIC_RUN_ID"])
def test_variables_that_tidal_sets_cannot_be_given(name: str) -> None:
    assert "set by tidal" in refused(env={name: "1"})


@pytest.mark.parametrize("name", ["1X", "A-B", "", "A B"])
def test_an_environment_variable_needs_a_valid_name(name: str) -> None:
    assert "not a valid name" in refused(env={name: "1"})


@pytest.mark.parametrize("path", ["/etc", "~/x", "a/../../b", "..", "a\\b", "a\0b"])
@pytest.mark.parametrize("field", ["working_dir", "checkpoint_dir"])
def test_paths_that_could_leave_their_root_are_refused(field: str, path: str) -> None:
    assert field in refused(**{field: path})


@pytest.mark.parametrize("name", ["-x", ".x", "a b", "x" * 41, "a/b"])
def test_a_job_name_is_a_short_readable_label(name: str) -> None:
    assert "name" in refused(name=name)


def test_unknown_fields_are_refused() -> None:
    assert "shell" in refused(shell=True)


def test_a_node_selector_needs_valid_label_keys() -> None:
    assert "node_selector" in refused(node_selector={"-bad": "x"})
    assert spec(node_selector={"gpu": "h100"}).node_selector == {"gpu": "h100"}


def test_a_resize_policy_reaches_the_workers_through_their_environment() -> None:
    policy = ResizePolicy(global_batch_size=512, lr_rule="sqrt")
    assert policy.env() == {"TIDAL_RESIZE_POLICY": "sqrt", "TIDAL_GLOBAL_BATCH_SIZE": "512"}


def test_zygote_preload_takes_dotted_module_names_in_order() -> None:
    assert spec().zygote_preload == []
    names = ["transformers", "lightning.pytorch", "_private", "torch.nn.functional", "a1.b_2"]
    assert spec(zygote_preload=names).zygote_preload == names
    assert spec(zygote_preload=[f"m{i}" for i in range(32)]).zygote_preload[-1] == "m31"


@pytest.mark.parametrize(
    ("names", "error"),
    [
        (["transformers", "my-lib"], "zygote_preload[1] ('my-lib') is not a dotted Python module"),
        (["os; rm -rf /"], "zygote_preload[0] ('os; rm -rf /') is not a dotted Python module"),
        (["../evil"], "zygote_preload[0] ('../evil') is not a dotted Python module name"),
        ([".relative"], "zygote_preload[0] ('.relative') is not a dotted Python module name"),
        (["trailing."], "zygote_preload[0] ('trailing.') is not a dotted Python module name"),
        (["a..b"], "zygote_preload[0] ('a..b') is not a dotted Python module name"),
        (["1st"], "zygote_preload[0] ('1st') is not a dotted Python module name"),
        ([""], "zygote_preload[0] ('') is not a dotted Python module name"),
        (["torch\n"], "zygote_preload[0] ('torch\\n') is not a dotted Python module name"),
        (["torch,numpy"], "zygote_preload[0] ('torch,numpy') is not a dotted Python module"),
        (["caf\u00e9"], "zygote_preload[0] ('caf\u00e9') is not a dotted Python module name"),
        (["numpy", "scipy", "numpy"], "zygote_preload[2] ('numpy') is given twice"),
        (["m" * 201], "zygote_preload[0] ('mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm'...) is 201"),
        ([f"m{i}" for i in range(33)], "zygote_preload has 33 modules; at most 32 are allowed"),
        ("transformers", "zygote_preload"),  # a list, not a comma-separated string
        ([1], "zygote_preload.0"),
    ],
)
def test_zygote_preload_refuses_what_is_not_a_module_name_naming_it(
    names: object, error: str
) -> None:
    assert error in refused(zygote_preload=names)


def test_zygote_preload_is_described_in_the_openapi_schema() -> None:
    field = JobSpec.model_json_schema()["properties"]["zygote_preload"]
    assert "zygote" in field["description"] and field["maxItems"] == 32
    assert field["items"]["pattern"] == MODULE_NAME_PATTERN and field["uniqueItems"] is True


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
    st.text(max_size=20), st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)


@given(st.dictionaries(
    st.sampled_from(["name", "command", "working_dir", "env", "min_nodes", "max_nodes",
                     "nproc_per_node", "checkpoint_dir", "max_restarts", "node_selector",
                     "priority", "resize_policy", "grace_period_s", "zygote_preload",
                     "other"]),
    _VALUES, max_size=8,
))
@settings(max_examples=200, deadline=None)
def test_any_input_is_a_valid_spec_or_a_validation_error(data: dict[str, Any]) -> None:
    try:
        s = JobSpec.model_validate(data)
    except ValidationError:
        return
    assert 1 <= s.min_nodes <= s.max_nodes


def test_a_scale_request_needs_a_bound() -> None:
    with pytest.raises(ValidationError, match="give min_nodes, max_nodes or both"):
        ScaleRequest()
    assert ScaleRequest(max_nodes=3).min_nodes is None


# JobPhase --------------------------------------------------------------------------------


def test_every_phase_has_its_transitions_written_down() -> None:
    assert set(TRANSITIONS) == set(JobPhase)


@pytest.mark.parametrize("end", TERMINAL)
@pytest.mark.parametrize("to", list(JobPhase))
def test_a_terminal_phase_is_never_left(end: JobPhase, to: JobPhase) -> None:
    assert end.is_terminal()
    with pytest.raises(IllegalTransitionError, match=f"from {end.value} to {to.value}"):
        end.check_transition(to)


@pytest.mark.parametrize("start", LIVE)
def test_a_live_job_can_end_any_way_and_move_between_live_phases(start: JobPhase) -> None:
    assert not start.is_terminal()
    for to in JobPhase:
        if to != start:
            start.check_transition(to)


def test_an_illegal_transition_is_a_value_error() -> None:
    assert issubclass(IllegalTransitionError, ValueError)


# conditions ------------------------------------------------------------------------------


def test_a_condition_keeps_its_transition_time_until_its_status_changes() -> None:
    record = JobRecord(job_id="j", spec=spec())
    record.set_condition("Running", False, "below_min_nodes", now=T0)
    record.set_condition("Running", False, "restarted", "waiting", now=T0 + timedelta(1))
    [cond] = record.conditions
    assert (cond.reason, cond.last_transition_time) == ("restarted", T0)
    record.set_condition("Running", True, "restarted", now=T0 + timedelta(2))
    [cond] = record.conditions
    assert cond.status and cond.last_transition_time == T0 + timedelta(2)


def test_a_queue_patch_takes_null_only_for_the_limit() -> None:
    assert QueuePatch.model_validate({"limit": None}).model_fields_set == {"limit"}
    for name in ("guaranteed", "weight"):
        with pytest.raises(ValidationError, match=f"{name} cannot be null"):
            QueuePatch.model_validate({name: None, "limit": 3})
