"""The GPUs' metrics, read at scrape time from the agent's last GPU poll.

A scrape never calls NVML (a call can block on a sick GPU): it reads the
snapshot :class:`agent.gpu.nvml.GpuMonitor` keeps. Every series carries the node
(``node_id``) and the GPU (``gpu``, NVML's index); the readings carry the job
that holds the GPU (``job_id``, empty while it is free), so a dashboard can
sum a job's GPUs over its nodes. The names follow tidal's rules (``tidal_agent_``
prefix, base units); docs/metrics.md maps each to dcgm-exporter's
(``DCGM_FI_DEV_GPU_UTIL`` ...), for those who run both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.gpu.nvml import GpuSnapshot


class GpuCollector(Collector):
    """Per-GPU series of one node.

    Args:
        node_id: the node's id.
        snapshot: the GPUs' last poll.
        held: job id -> the devices its runner holds.
    """

    def __init__(
        self,
        node_id: str,
        snapshot: Callable[[], GpuSnapshot],
        held: Callable[[], Mapping[str, Sequence[int]]],
    ) -> None:
        self._node = node_id
        self._snapshot = snapshot
        self._held = held

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        holder = {i: job for job, devices in self._held().items() for i in devices}
        node = self._node
        info = GaugeMetricFamily("tidal_agent_gpu_info", "Always 1: each GPU's UUID and model.",
                                 labels=["node_id", "gpu", "uuid", "model"])
        healthy = GaugeMetricFamily("tidal_agent_gpu_healthy",
                                    "1 while the GPU is in the node's offer, 0 once it failed.",
                                    labels=["node_id", "gpu"])
        total = GaugeMetricFamily("tidal_agent_gpu_memory_total_bytes", "Device memory.",
                                  labels=["node_id", "gpu"])
        held = GaugeMetricFamily("tidal_agent_gpu_job", "1 for the job that holds the GPU.",
                                 labels=["node_id", "gpu", "job_id"])
        per_job = ["node_id", "gpu", "job_id"]
        readings = {
            "utilization_pct": GaugeMetricFamily(
                "tidal_agent_gpu_utilization_ratio",
                "Fraction of the last sample period the GPU was busy.", labels=per_job),
            "memory_used_bytes": GaugeMetricFamily(
                "tidal_agent_gpu_memory_used_bytes", "Device memory in use.", labels=per_job),
            "power_w": GaugeMetricFamily(
                "tidal_agent_gpu_power_watts", "Power draw.", labels=per_job),
            "temperature_c": GaugeMetricFamily(
                "tidal_agent_gpu_temperature_celsius", "Core temperature.", labels=per_job),
        }
        for gpu in snap.gpus:
            index = str(gpu.index)
            info.add_metric([node, index, gpu.uuid, gpu.model], 1.0)
            healthy.add_metric([node, index], 1.0 if gpu.healthy else 0.0)
            if gpu.memory_bytes:
                total.add_metric([node, index], float(gpu.memory_bytes))
            job = holder.get(gpu.index, "")
            if job:
                held.add_metric([node, index, job], 1.0)
            reading = snap.readings.get(gpu.index)
            if reading is None:
                continue
            for name, family in readings.items():
                value = getattr(reading, name)
                if value is None:
                    continue
                scale = 0.01 if name == "utilization_pct" else 1.0
                family.add_metric([node, index, job], float(value) * scale)
        yield from (info, healthy, total, held, *readings.values())
