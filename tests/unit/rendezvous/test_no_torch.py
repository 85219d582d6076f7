"""Importing rendezvous (all but the torch-facing handlers) must not import torch.

The coordinator imports rendezvous and must stay light; only
rendezvous/torch_backend.py and rendezvous/assigned.py (the handlers torch
elastic calls, with assigned_join.py, the latter's own join record) and
rendezvous/etcd_store.py (their c10d store) may import torch.
"""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import rendezvous
names = [m.name for m in pkgutil.iter_modules(rendezvous.__path__)
         if m.name not in ("torch_backend", "assigned", "assigned_join", "etcd_store")]
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
    assert {"client", "keys", "errors", "etcd_server", "liveness",
            "assigned_rounds"} <= set(imported)
