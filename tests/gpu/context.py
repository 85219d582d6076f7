"""What the GPU check's parts share: where things go, the machine, the processes, the cluster."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from pathlib import Path
from typing import Any

from tests.gpu.cluster import ClusterError, TidalUp
from tests.gpu.procs import Deadline, Processes
from tests.gpu.report import PartSkipped

NO_CUDA = "dry run: no CUDA on this machine"


@dataclasses.dataclass
class Machine:
    """What the probe found (``python -m tests.gpu.check`` runs it in a child: no CUDA
    context in the check's own process)."""

    torch: str = "?"
    cuda: str | None = None
    gpus: int = 0
    gpu_names: list[str] = dataclasses.field(default_factory=list)
    nccl: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Machine:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


PROBE = """
import json, sys
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": 0, "gpu_names": []}
if torch.cuda.is_available():
    info["gpus"] = torch.cuda.device_count()
    info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpus"])]
    try:
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # no NCCL in this build: part 6 says so
        info["nccl"] = f"unknown ({type(exc).__name__})"
open(sys.argv[1], "w").write(json.dumps(info))
"""


@dataclasses.dataclass
class Context:
    """The run's shared state.

    Attributes:
        dry_run: no CUDA here: what needs it is skipped, the rest runs on the CPU.
        repo: the repository root (every child runs there).
        out: where the results and logs go.
        work: scratch space on disk (checkpoints of GBs; removed at the end).
        procs: every process the run starts.
    """

    dry_run: bool
    repo: Path
    out: Path
    work: Path
    procs: Processes
    python: str = sys.executable
    machine: Machine = dataclasses.field(default_factory=Machine)
    _cluster: TidalUp | None = None
    _cluster_error: str | None = None

    @property
    def cuda(self) -> bool:
        return self.machine.gpus > 0

    def need_cuda(self, what: str = "") -> None:
        """End the part as skipped where there is no GPU (saying why)."""
        if not self.cuda:
            raise PartSkipped(NO_CUDA if self.dry_run else
                              f"torch {self.machine.torch} sees no CUDA GPU{what}")

    def probe(self, timeout: float) -> Machine:
        path = self.out / "logs" / "probe.json"
        code = self.procs.run([self.python, "-c", PROBE, str(path)], log_name="probe.log",
                              timeout=timeout, cwd=self.repo)
        if code != 0 or not path.exists():
            raise RuntimeError(f"the probe of torch and CUDA failed ({code}): "
                               f"{self.procs.log_tail('probe.log', 5)}")
        self.machine = Machine.from_json(json.loads(path.read_text()))
        return self.machine

    def tidal(self, deadline: Deadline) -> TidalUp:
        """The run's ``tidal up``, started by the first part that needs it.

        Raises:
            ClusterError: it did not start (now or for an earlier part: not tried again).
        """
        if self._cluster is not None:
            return self._cluster
        if self._cluster_error is not None:
            raise ClusterError(f"tidal up did not start earlier: {self._cluster_error}")
        cluster = TidalUp(self.procs, state_dir=self.work / "tidal", repo=self.repo,
                          python=self.python, gpus_per_agent=None if self.cuda else 1)
        try:
            cluster.start(deadline)
        except Exception as exc:
            self._cluster_error = str(exc)[:2000]
            cluster.stop()
            raise
        self._cluster = cluster
        return cluster

    def stop_cluster(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None


def free_port() -> int:
    """A port free now (a later bind may race; the part then fails and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file a worker wrote atomically, or None while it is not there."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
