"""What importing really loads, each in a fresh interpreter (the static rule over every
import statement is tests/unit/test_layers.py).

Importing rendezvous (all but the torch-facing handlers) must not import torch:
the coordinator imports rendezvous and must stay light; only
rendezvous/elastic/etcd_v3.py and rendezvous/elastic/assigned.py (the handlers torch
elastic calls, with assigned_join.py, the latter's own join record) and
rendezvous/elastic/store.py (their c10d store) may import torch. Nor may the agent
daemon with its metrics, nor the runner's reading of the live resize's files
(checkpoints.protocol.live); and the library with its Hugging Face callback must
not import transformers until a Trainer uses it.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support.no_torch import assert_imports_without_torch

CHECK = """
import importlib, pkgutil, sys
import rendezvous
TORCH = {"elastic.etcd_v3", "elastic.assigned", "elastic.assigned_join", "elastic.store"}
names = [m.name[len("rendezvous."):]
         for m in pkgutil.walk_packages(rendezvous.__path__, "rendezvous.")
         if m.name[len("rendezvous."):] not in TORCH]
for name in names:
    importlib.import_module("rendezvous." + name)
assert "torch" not in sys.modules, "torch was imported by rendezvous"
print(",".join(sorted(names)))
"""


def test_rendezvous_modules_import_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    imported = out.stdout.strip().split(",")
    assert {"etcd", "keys", "errors", "etcd.server", "elastic.liveness",
            "elastic.assigned_rounds"} <= set(imported)


def test_the_daemon_exports_metrics_without_importing_torch() -> None:
    assert_imports_without_torch("agent.node.daemon", "agent.node.metrics", "agent.runner.status",
                                 "service.up.prometheus")


def test_the_live_files_and_the_runners_decisions_import_without_torch() -> None:
    assert_imports_without_torch("checkpoints.protocol.live", "agent.runner.live_decide")


def test_importing_checkpoints_and_the_module_does_not_import_transformers() -> None:
    code = ("import sys, checkpoints, checkpoints.frameworks.hf; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
