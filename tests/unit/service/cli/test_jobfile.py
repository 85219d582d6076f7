"""Job files: YAML text and command-line overrides to a job spec's fields, or an error
naming the file, the line and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.models import JobSpec
from service.cli.jobfile import JobFileError, job_fields

FULL = """\
name: train
command: [python, train.py, --lr, 0.1, --resume, yes]
working_dir: proj
checkpoint_dir: ckpt/train
env:
  OMP_NUM_THREADS: 4
  MODE: "fast"
min_nodes: 2
max_nodes: 4
nproc_per_node: 8
priority: 5
max_restarts: 1
grace_period_s: 12.5
node_selector:
  zone: a
resize_policy:
  global_batch_size: 256
  lr_rule: sqrt
zygote_preload: [transformers, lightning.pytorch]
"""


def error(text: str, overrides: dict[str, object] | None = None) -> str:
    with pytest.raises(JobFileError) as caught:
        job_fields(text, overrides, source="job.yaml")
    return str(caught.value)


def test_every_field_of_the_spec_is_read_and_scalars_in_lists_stay_as_written() -> None:
    fields = job_fields(FULL)
    spec = JobSpec(**fields)
    assert spec.command == ["python", "train.py", "--lr", "0.1", "--resume", "yes"]
    assert spec.env == {"OMP_NUM_THREADS": "4", "MODE": "fast"}
    assert (spec.min_nodes, spec.max_nodes, spec.nproc_per_node) == (2, 4, 8)
    assert (spec.priority, spec.max_restarts, spec.grace_period_s) == (5, 1, 12.5)
    assert (spec.working_dir, spec.checkpoint_dir) == ("proj", "ckpt/train")
    assert spec.node_selector == {"zone": "a"}
    assert spec.resize_policy is not None
    assert (spec.resize_policy.global_batch_size, spec.resize_policy.lr_rule) == (256, "sqrt")
    assert spec.zygote_preload == ["transformers", "lightning.pytorch"]


def test_the_example_job_file_is_valid() -> None:
    path = Path(__file__).parents[4] / "examples" / "job.yaml"
    spec = JobSpec(**job_fields(path.read_text(), source=str(path)))
    assert spec.command[:2] == ["python", "examples/mlp.py"]


def test_flags_override_the_file_and_merge_into_its_mappings() -> None:
    fields = job_fields(FULL, {
        "name": "other", "max_nodes": 6, "priority": None, "command": ["true"],
        "env": {"MODE": "slow", "EXTRA": "1"}, "node_selector": {"rack": "r1"},
        "resize_policy": {"lr_rule": "linear"},
    })
    spec = JobSpec(**fields)
    assert (spec.name, spec.max_nodes, spec.priority, spec.command) == ("other", 6, 5, ["true"])
    assert spec.env == {"OMP_NUM_THREADS": "4", "MODE": "slow", "EXTRA": "1"}
    assert spec.node_selector == {"zone": "a", "rack": "r1"}
    assert spec.resize_policy is not None
    assert (spec.resize_policy.global_batch_size, spec.resize_policy.lr_rule) == (256, "linear")


def test_a_job_file_names_its_queue() -> None:
    assert job_fields("command: [x]\nqueue: team-a\n")["queue"] == "team-a"
    assert job_fields("command: [x]\nqueue: team-a\n", {"queue": "b"})["queue"] == "b"


def test_max_nodes_defaults_to_min_nodes_and_a_command_may_come_from_the_command_line() -> None:
    assert job_fields("min_nodes: 3\n", {"command": ["true"]})["max_nodes"] == 3
    assert "name" not in job_fields("command: [true]\n")  # the caller names it


@pytest.mark.parametrize(("text", "wanted"), [
    ("command: [x]\ngpus: 2\n", "job.yaml:2: unknown key 'gpus' (the key is gpus_per_node)"),
    ("command: [x]\nqueue: a/b\n", "job.yaml:2: queue: String should match pattern"),
    ("command: [x]\nlabels: {a: b}\n", "job.yaml:2: unknown key 'labels' (the key is node_"),
    ("command: [x]\n\nmax_node: 2\n", "job.yaml:3: unknown key 'max_node' (did you mean max_"),
    ("command: [x]\nresize_policy:\n  lr_rul: sqrt\n",
     "job.yaml:3: unknown key 'lr_rul' in resize_policy (did you mean lr_rule?"),
    ("command: [x]\ncommand: [y]\n", "job.yaml:2: key 'command' is given twice (first on line 1)"),
])
def test_unknown_or_repeated_keys_name_the_key_and_its_line(text: str, wanted: str) -> None:
    assert error(text).startswith(wanted)


@pytest.mark.parametrize(("text", "wanted"), [
    ("command: [x]\nmin_nodes: two\n", "job.yaml:2: min_nodes: Input should be a valid integer"),
    ("command: [x]\nmax_restarts: true\n", "job.yaml:2: max_restarts: Input should be a valid"),
    ("command: [x]\nresize_policy:\n  lr_rule: cube\n", "job.yaml:3: resize_policy.lr_rule:"),
    ("command: python train.py\n", "job.yaml:1: command: must be a list of arguments"),
    ("command:\n  - x\n  - [y]\n", "job.yaml:3: command[1]: must be a string"),
    ("command: [x]\nenv: [A]\n", "job.yaml:2: env: must be a mapping"),
    ("command: [x]\nenv:\n  A:\n", "job.yaml:3: env.A: must be a string"),
    ("command: [x]\nworking_dir: ../up\n", "job.yaml:2: working_dir:"),
    ("command: [x]\nmin_nodes: 3\nmax_nodes: 1\n", "job.yaml:2: min_nodes:"),
    ("command: [x]\nzygote_preload: [transformers, my-lib]\n",
     "job.yaml:2: zygote_preload: Value error, zygote_preload[1] ('my-lib') is not a dotted"),
    ("command: [x]\nzygote_preload: transformers\n", "job.yaml:2: zygote_preload: Input should"),
    ("name: x\n", "job.yaml: no command"),
    ("", "job.yaml: empty"),
    ("- a\n", "job.yaml:1: the file must be a mapping"),
    ("command: [x\n", "job.yaml:2: not valid YAML"),
])
def test_type_errors_name_the_field_and_its_line(text: str, wanted: str) -> None:
    assert error(text).startswith(wanted)


def test_an_overridden_field_is_blamed_on_the_command_line_not_the_file() -> None:
    assert error("command: [x]\nmin_nodes: 1\n", {"min_nodes": 0}).startswith(
        "job.yaml: min_nodes (from the command line):")


def test_only_safe_yaml_is_read_and_env_values_are_never_echoed() -> None:
    message = error("command: [x]\npriority: !!python/object/apply:os.system [echo hi]\n")
    assert message.startswith("job.yaml:2: priority: could not determine a constructor")
    secret = "s3cr3t-value"
    message = error(f"command: [x]\nenv:\n  TIDAL_TOKEN: {secret}\n")
    assert message.startswith("job.yaml:2: env: ") and secret not in message
