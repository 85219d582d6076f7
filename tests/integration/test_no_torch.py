"""Importing rendezvous (all but the torch-facing handlers) must not import torch.

The coordinator imports rendezvous and must stay light; only
rendezvous/elastic/etcd_v3.py and rendezvous/elastic/assigned.py (the handlers torch
elastic calls, with assigned_join.py, the latter's own join record) and
rendezvous/elastic/store.py (their c10d store) may import torch.
"""

from __future__ import annotations

import subprocess
import sys

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
