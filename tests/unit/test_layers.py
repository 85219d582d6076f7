"""The layer rules of the source tree, checked on every import statement (``make lint`` runs this).

service > agent > (rendezvous | checkpoints): a package imports only the packages
below it; rendezvous and checkpoints import nothing of ours; the worker protocol
(checkpoints.protocol) is standard library only; torch is imported only where a
process trains or drives torch elastic. Imports inside functions count (they run
too); imports under ``if TYPE_CHECKING:`` do not.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "agent", "rendezvous", "checkpoints")

#: Which of our packages each package may import.
ALLOWED: dict[str, set[str]] = {
    "checkpoints": set(),
    "rendezvous": set(),
    "agent": {"rendezvous", "checkpoints"},
    "service": {"rendezvous", "checkpoints", "agent"},
}
#: service may reach agent only where the `tidal` command starts an agent in-process.
SERVICE_TO_AGENT = ("service.cli.",)
#: service may use only the worker protocol of checkpoints (no torch).
SERVICE_TO_CHECKPOINTS = ("checkpoints.protocol",)
#: The modules that may import torch: the library, the runner, the zygote that
#: preloads it, and the rendezvous pieces torch elastic calls.
TORCH_ALLOWED = (
    "checkpoints.",
    "agent.runner.",
    "agent.workers.zygote",
    "rendezvous.elastic.assigned",
    "rendezvous.elastic.assigned_join",
    "rendezvous.elastic.etcd_v3",
    "rendezvous.elastic.store",
)
TORCH_FORBIDDEN = ("checkpoints.protocol.",)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted
    line: int


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports() -> list[Import]:
    found: list[Import] = []
    for module, path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                found += [Import(module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found += [Import(module, f"{node.module}.{alias.name}", node.lineno)
                          for alias in node.names]
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def _starts(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p.rstrip(".") or name.startswith(p) for p in prefixes)


def layer_violations(found: list[Import]) -> list[str]:
    """Every import that crosses the layers the wrong way, as 'module:line -> target'."""
    bad = []
    for imp in found:
        source, target = _top(imp.module), _top(imp.target)
        if target not in PACKAGES or target == source:
            continue
        allowed = target in ALLOWED[source]
        if source == "service" and target == "agent":
            allowed = _starts(imp.module + ".", SERVICE_TO_AGENT)
        if source == "service" and target == "checkpoints":
            allowed = _starts(imp.target, SERVICE_TO_CHECKPOINTS)
        if not allowed:
            bad.append(f"{imp.module}:{imp.line} -> {imp.target}")
    return bad


def torch_violations(found: list[Import]) -> list[str]:
    bad = []
    for imp in found:
        if _top(imp.target) != "torch":
            continue
        if _starts(imp.module + ".", TORCH_FORBIDDEN) or not _starts(imp.module, TORCH_ALLOWED):
            bad.append(f"{imp.module}:{imp.line} -> {imp.target}")
    return bad


def protocol_violations(found: list[Import]) -> list[str]:
    """checkpoints.protocol: the standard library and itself only."""
    bad = []
    for imp in found:
        if not _starts(imp.module, ("checkpoints.protocol",)):
            continue
        top = _top(imp.target)
        if top == "__future__" or top in sys.stdlib_module_names:
            continue
        if not imp.target.startswith("checkpoints.protocol."):
            bad.append(f"{imp.module}:{imp.line} -> {imp.target}")
    return bad


@pytest.fixture(scope="module")
def found() -> list[Import]:
    return imports()


def test_each_package_imports_only_the_layers_below_it(found: list[Import]) -> None:
    assert layer_violations(found) == []


def test_torch_is_imported_only_where_a_process_trains_or_drives_torch_elastic(
    found: list[Import],
) -> None:
    assert torch_violations(found) == []


def test_the_worker_protocol_is_standard_library_only(found: list[Import]) -> None:
    assert protocol_violations(found) == []


def test_the_rules_catch_what_they_are_for() -> None:
    made_up = [
        Import("checkpoints.data", "rendezvous.keys.validate_id", 1),
        Import("rendezvous.registry", "agent.spec.RunnerSpec", 2),
        Import("service.coordinator.app", "agent.node.daemon.Agent", 3),
        Import("service.api.models", "checkpoints.checkpointer.Checkpointer", 4),
        Import("service.cli.main", "agent.node.daemon.Agent", 5),
        Import("agent.node.daemon", "torch", 6),
        Import("checkpoints.protocol.env", "torch.distributed", 7),
        Import("checkpoints.protocol.env", "pydantic.BaseModel", 8),
        Import("checkpoints.data", "torch", 9),
    ]
    assert layer_violations(made_up) == [
        "checkpoints.data:1 -> rendezvous.keys.validate_id",
        "rendezvous.registry:2 -> agent.spec.RunnerSpec",
        "service.coordinator.app:3 -> agent.node.daemon.Agent",
        "service.api.models:4 -> checkpoints.checkpointer.Checkpointer",
    ]
    assert torch_violations(made_up) == [
        "agent.node.daemon:6 -> torch",
        "checkpoints.protocol.env:7 -> torch.distributed",
    ]
    assert protocol_violations(made_up) == [
        "checkpoints.protocol.env:7 -> torch.distributed",
        "checkpoints.protocol.env:8 -> pydantic.BaseModel",
    ]


#: "No package folder holds more than about 15 modules" (issue #23); past that, a
#: concept in it deserves its own folder.
MAX_MODULES_PER_FOLDER = 16


def test_no_folder_holds_more_than_about_fifteen_modules() -> None:
    crowded = {}
    for package in PACKAGES:
        for folder in [ROOT / package, *(ROOT / package).rglob("*")]:
            if folder.is_dir() and (folder / "__init__.py").exists():
                modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
                if len(modules) > MAX_MODULES_PER_FOLDER:
                    crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert crowded == {}


def test_no_module_repeats_its_folder_as_a_prefix() -> None:
    """A family of files sharing a prefix is a folder in disguise (STYLE.md, rule 1)."""
    repeats = [str(path.relative_to(ROOT)) for _, path in _modules()
               if path.stem.startswith(path.parent.name.rstrip("s") + "_")]
    assert repeats == []
