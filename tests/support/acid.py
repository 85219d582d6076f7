"""The acid tests' common parts: the uninterrupted reference run and the comparison.

Every acid test runs examples/mlp.py (float64) twice: elastically, through
whatever the test does to it, and uninterrupted under plain
``torchrun --standalone``; both write ``--record`` (the final parameters, the
samples of each step), and the parameters must be equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tests.support.processes import ProcessGroupRegistry

MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"


def start_reference(
    procs: ProcessGroupRegistry, tmp_path: Path, args: Sequence[str], *, nproc: int = 2
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start mlp.py with ``args`` under ``torchrun --standalone``, uninterrupted;
    returns the process and where its record will be."""
    record = tmp_path / "reference.json"
    proc = procs.spawn(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(MLP), "--checkpoint-dir", str(tmp_path / "ref-ckpt"),
         *args, "--record", str(record)],
        log_path=tmp_path / "reference.log",
    )
    return proc, record


def wait_reference(proc: subprocess.Popen[bytes], tmp_path: Path, *,
                   timeout: float = 300) -> None:
    """The reference run ended well (else its log's tail)."""
    assert proc.wait(timeout=timeout) == 0, (tmp_path / "reference.log").read_text()[-3000:]


def record_params(record: dict[str, Any] | Path) -> dict[str, torch.Tensor]:
    """The final parameters of a ``--record`` file (or its parsed content)."""
    data = json.loads(record.read_text()) if isinstance(record, Path) else record
    return {
        name: torch.tensor(p["values"], dtype=torch.float64).reshape(p["shape"])
        for name, p in data["params"].items()
    }


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of parameters."""
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *,
                       atol: float = 1e-10) -> None:
    """Equal to ``atol`` (float64 sums in another order differ in the last bits)."""
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
