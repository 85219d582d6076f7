"""The GPU records agents publish and the coordinator places jobs by.

An agent describes each of its GPUs in its node record
(:attr:`rendezvous.registry.NodeInfo.gpu_devices`) as a :class:`GpuInfo`:
index, UUID, model, memory, locality (NUMA node, NVLink island) and health.
A GPU that is not healthy is out of the node's offer: the coordinator counts
only healthy GPUs as capacity (:func:`gpus_free`), and the agent gives a job
only healthy devices (``agent.gpu.devices``). ``fault`` says why a GPU is out, in
words an operator reads in ``tidal nodes``.

The workers of a job see their devices through ``CUDA_VISIBLE_DEVICES``, with
CUDA's numbering made the same as NVML's by ``CUDA_DEVICE_ORDER``
(:func:`checkpoints.protocol.env.device_env`), so a script that uses ``cuda:LOCAL_RANK`` runs on the
job's own devices unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Most GPUs one node may describe.
MAX_GPUS = 1024

_TEXT_RE = re.compile(r"^[\x20-\x7e]*$")


class GpuInfo(BaseModel):
    """One GPU of a node, as its agent publishes it (JSON in the node record).

    Attributes:
        index: NVML's index (PCI bus order), the number ``CUDA_VISIBLE_DEVICES`` names.
        uuid: NVML's UUID (``GPU-...``), or "" where it is not known (explicit
            indices on a machine without NVML).
        model: the product name ("NVIDIA H100 80GB HBM3"), or "".
        memory_bytes: total device memory (0 if not known).
        numa_node: the NUMA node the GPU hangs off, if known.
        island: the GPUs joined by NVLink share an island id (the lowest UUID
            or index among them), if known.
        healthy: False once the agent saw the GPU fail; it then leaves the offer.
        fault: why it is not healthy ("XID 79: fell off the bus"), else "".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0, lt=MAX_GPUS)
    uuid: str = Field(default="", max_length=96)
    model: str = Field(default="", max_length=96)
    memory_bytes: int = Field(default=0, ge=0)
    numa_node: int | None = Field(default=None, ge=0, le=4096)
    island: str | None = Field(default=None, max_length=96)
    healthy: bool = True
    fault: str = Field(default="", max_length=256)

    @field_validator("uuid", "model", "island", "fault")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is not None and not _TEXT_RE.match(value):
            raise ValueError("must be printable ASCII")
        return value


class HasGpus(Protocol):
    """What :func:`gpus_free` reads of a node record."""

    @property
    def healthy_gpus(self) -> int: ...


class HoldsGpus(Protocol):
    """What :func:`gpus_free` reads of an assignment."""

    @property
    def gpus_per_node(self) -> int: ...


def check_indices(gpus: Sequence[GpuInfo]) -> Sequence[GpuInfo]:
    """Refuse a GPU list that names one index twice.

    Raises:
        ValueError: naming the index.
    """
    seen: set[int] = set()
    for gpu in gpus:
        if gpu.index in seen:
            raise ValueError(f"GPU index {gpu.index} is listed twice")
        seen.add(gpu.index)
    return gpus


def gpus_free(
    node: HasGpus, node_id: str, placed: Iterable[Mapping[str, HoldsGpus]]
) -> int:
    """The healthy GPUs of ``node`` that no assignment on it asks for.

    Args:
        node: the node's record.
        node_id: its id.
        placed: per job, node id -> that job's assignment there (the jobs'
            assignments as the scheduler keeps them).
    """
    asked = sum(per_node[node_id].gpus_per_node for per_node in placed if node_id in per_node)
    return node.healthy_gpus - asked
