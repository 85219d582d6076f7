"""Whether modules import without torch: the agent daemon and the coordinator must stay light."""

from __future__ import annotations

import subprocess
import sys


def assert_imports_without_torch(*modules: str) -> None:
    """Import ``modules`` in a fresh interpreter and fail if that imported torch."""
    check = (
        f"import sys, {', '.join(modules)}\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
