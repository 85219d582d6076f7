"""Job files: a job spec written in YAML, as ``tidal submit -f job.yaml`` reads it.

The keys are :class:`service.api.models.JobSpec`'s fields (``resize_policy`` a
mapping of its own); flags given on the command line override the file, a
command after ``--`` replaces the file's ``command``. :func:`job_fields` is
pure: text and overrides in, the spec's fields out, or a :class:`JobFileError`
naming the file, the line and the key.

YAML is read with PyYAML's safe loader only (no arbitrary tags). The entries of
``command``, ``env`` and ``node_selector`` are taken as written, so
``--lr: 0.1``, ``OMP_NUM_THREADS: 4`` or ``debug: yes`` stay the strings a
process sees, not a float, an int or a boolean.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from service.api.models import JobSpec, ResizePolicy

# Where a key or value was written: a path of keys and list indices -> its 1-based line.
Lines = dict[tuple[str | int, ...], int]

STRING_MAPS = frozenset({"env", "node_selector"})
# Keys people reach for that are spelled differently here, or do not exist yet.
HINTS = {
    "labels": "the key is node_selector",
    "label": "the key is node_selector",
    "workdir": "the key is working_dir",
    "grace_period": "the key is grace_period_s (seconds)",
    "restarts": "the key is max_restarts",
    "gpus": "the key is gpus_per_node",
    "global_batch_size": "it belongs under resize_policy",
    "lr_rule": "it belongs under resize_policy",
}


class JobFileError(ValueError):
    """A job file that cannot be used: the message names the file, the line and the key."""


def job_fields(
    text: str, overrides: Mapping[str, Any] | None = None, *, source: str = "job file"
) -> dict[str, Any]:
    """The fields of a valid :class:`JobSpec` from a job file and the command line.

    ``overrides`` holds what was given as flags (``None`` values are ignored):
    it replaces the file's value, except ``env`` and ``node_selector`` whose
    entries are merged over the file's, and ``resize_policy`` whose keys are.
    Without a ``name``, the caller supplies one (the result may lack it);
    without ``max_nodes``, it is ``min_nodes``, as on the command line.

    Raises:
        JobFileError: ``"<source>:<line>: <key>: <what is wrong>"``; values are
            never echoed (``env`` may hold secrets).
    """
    fields, lines = parse(text, source=source)
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    for key, value in given.items():
        if key in STRING_MAPS or key == "resize_policy":
            merged = dict(fields.get(key) or {})
            merged.update(value)
            fields[key] = merged
            for sub in value:
                lines.pop((key, sub), None)
        else:
            fields[key] = value
            for path in [p for p in lines if p[:1] == (key,)]:
                del lines[path]
    if "command" not in fields:
        raise JobFileError(f"{source}: no command: give one in the file or after `--`")
    if "min_nodes" in fields and "max_nodes" not in fields:
        fields["max_nodes"] = fields["min_nodes"]
    check(fields, lines, source=source)
    return fields


def parse(text: str, *, source: str = "job file") -> tuple[dict[str, Any], Lines]:
    """The file's keys and values, and the line of each; only JobSpec's keys are allowed.

    Raises:
        JobFileError: not YAML, not one mapping, an unknown or repeated key.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise JobFileError(f"{source}:{_where(exc)} not valid YAML: {_problem(exc)}") from None
    if root is None:
        raise JobFileError(f"{source}: empty; it needs at least a command")
    if not isinstance(root, yaml.MappingNode):
        raise JobFileError(f"{source}:{_line(root)}: the file must be a mapping of key: value")
    fields: dict[str, Any] = {}
    lines: Lines = {}
    allowed = set(JobSpec.model_fields)
    for key_node, value_node in _pairs(root, source=source, allowed=allowed, parent=()):
        key = key_node.value
        lines[(key,)] = _line(key_node)
        if key == "command":
            fields[key] = _strings(value_node, source=source, key=key, lines=lines)
        elif key in STRING_MAPS:
            fields[key] = _string_map(value_node, source=source, key=key, lines=lines)
        elif key == "resize_policy":
            fields[key] = _policy(value_node, source=source, lines=lines)
        else:
            fields[key] = _value(value_node, source=source, key=key)
    return fields, lines


def check(fields: Mapping[str, Any], lines: Lines, *, source: str = "job file") -> None:
    """Validate ``fields`` as a :class:`JobSpec`, naming the line of the first bad key.

    A field without a name is checked with a placeholder one (the caller names it).

    Raises:
        JobFileError: the field, its line (or "from the command line") and the problem.
    """
    try:
        JobSpec(**{"name": "job", **fields})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"]) or ("min_nodes",)  # the one check of the whole spec: bounds
        field = ".".join(str(part) for part in loc) or "job"
        where = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
        if where is not None:
            prefix = f"{source}:{where}: {field}"
        elif loc and loc[0] in fields:
            prefix = f"{source}: {field} (from the command line)"
        else:
            prefix = f"{source}: {field}"
        raise JobFileError(f"{prefix}: {err['msg']}") from None


# reading nodes -------------------------------------------------------------------------


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{mark.line + 1}:" if mark is not None else ""


def _problem(exc: yaml.YAMLError) -> str:
    return str(getattr(exc, "problem", None) or exc).strip()


def _pairs(
    node: yaml.MappingNode, *, source: str, allowed: set[str] | None, parent: tuple[str, ...]
) -> list[tuple[yaml.ScalarNode, yaml.Node]]:
    """The key and value nodes of a mapping: keys are plain strings, known, and unique."""
    seen: dict[str, int] = {}
    out: list[tuple[yaml.ScalarNode, yaml.Node]] = []
    inside = f" in {'.'.join(parent)}" if parent else ""
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            raise JobFileError(f"{source}:{_line(key_node)}: '<<' merge keys are not supported")
        if not isinstance(key_node, yaml.ScalarNode) or not key_node.value:
            raise JobFileError(f"{source}:{_line(key_node)}: a key{inside} must be a word")
        key = str(key_node.value)
        if allowed is not None and key not in allowed:
            hint = HINTS.get(key) if not parent else None
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            if hint is None and close:
                hint = f"did you mean {close[0]}?"
            raise JobFileError(
                f"{source}:{_line(key_node)}: unknown key {key!r}{inside}"
                + (f" ({hint})" if hint else "")
                + f"; the keys are {', '.join(sorted(allowed))}"
            )
        if key in seen:
            raise JobFileError(
                f"{source}:{_line(key_node)}: key {key!r}{inside} is given twice "
                f"(first on line {seen[key]})"
            )
        seen[key] = _line(key_node)
        out.append((key_node, value_node))
    return out


def _value(node: yaml.Node, *, source: str, key: str) -> Any:
    """A value built by PyYAML's safe constructor (an unknown ``!tag`` is refused)."""
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise JobFileError(f"{source}:{_line(node)}: {key}: {_problem(exc)}") from None


def _scalar_text(node: yaml.Node, *, source: str, what: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or (
        node.tag == "tag:yaml.org,2002:null" and node.value in ("", "~", "null", "Null", "NULL")
        and node.style is None
    ):
        raise JobFileError(f"{source}:{_line(node)}: {what}: must be a string")
    return str(node.value)


def _strings(node: yaml.Node, *, source: str, key: str, lines: Lines) -> list[str]:
    if not isinstance(node, yaml.SequenceNode):
        raise JobFileError(
            f"{source}:{_line(node)}: {key}: must be a list of arguments, "
            "e.g. [python, train.py, --lr, '0.1'] (never a shell string)"
        )
    out = []
    for index, item in enumerate(node.value):
        lines[(key, index)] = _line(item)
        out.append(_scalar_text(item, source=source, what=f"{key}[{index}]"))
    return out


def _string_map(node: yaml.Node, *, source: str, key: str, lines: Lines) -> dict[str, str]:
    if not isinstance(node, yaml.MappingNode):
        raise JobFileError(f"{source}:{_line(node)}: {key}: must be a mapping of NAME: value")
    out = {}
    for name_node, value_node in _pairs(node, source=source, allowed=None, parent=(key,)):
        name = str(name_node.value)
        lines[(key, name)] = _line(name_node)
        out[name] = _scalar_text(value_node, source=source, what=f"{key}.{name}")
    return out


def _policy(node: yaml.Node, *, source: str, lines: Lines) -> dict[str, Any]:
    key = "resize_policy"
    if not isinstance(node, yaml.MappingNode):
        raise JobFileError(f"{source}:{_line(node)}: {key}: must be a mapping")
    out = {}
    allowed = set(ResizePolicy.model_fields)
    for sub_node, value_node in _pairs(node, source=source, allowed=allowed, parent=(key,)):
        sub = str(sub_node.value)
        lines[(key, sub)] = _line(sub_node)
        out[sub] = _value(value_node, source=source, key=f"{key}.{sub}")
    return out

