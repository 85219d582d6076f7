"""The agent's GPUs: inventory, offer, device choice and health, for the daemon.

:class:`NodeGpus` is what :class:`agent.node.daemon.Agent` knows of its GPUs. It
starts a :class:`agent.gpu.nvml.GpuMonitor` on the inventory the settings name,
says what the node record offers (on a GPU node a slot is a healthy GPU),
picks a job's devices (:func:`agent.gpu.devices.plan_devices`, preferring what
the job had last, remembered across agent restarts by
:class:`agent.gpu.devices.DeviceMemory`) and names the jobs that hold a GPU that
failed, which the daemon then takes off the node as if it had died.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from agent.gpu.devices import DeviceMemory, failed_devices, plan_devices
from agent.gpu.nvml import GpuMonitor, GpuSnapshot, call_with_deadline, open_inventory
from agent.node.settings import AgentSettings
from rendezvous.gpus import GpuInfo

log = logging.getLogger(__name__)


class NodeGpus:
    """One agent's GPUs. :meth:`start` it in the agent's ``run``; :meth:`stop` at the end.

    Args:
        settings: the agent's settings (``gpus``, ``gpu_inventory_file``, ``gpu_poll_s``).
    """

    def __init__(self, settings: AgentSettings) -> None:
        self._settings = settings
        self._monitor: GpuMonitor | None = None
        self._memory: DeviceMemory | None = None
        self._published: tuple[GpuInfo, ...] = ()
        self._pending: tuple[GpuInfo, ...] = ()

    def start(self, on_change: Callable[[], None]) -> NodeGpus:
        """Find the GPUs (a first poll with a deadline) and keep polling them.

        Raises:
            agent.gpu.nvml.GpuInventoryError, agent.gpu.nvml.DeadlineError: the GPUs
                cannot be listed; the agent cannot say what it offers.
        """
        s = self._settings
        selection = s.gpu_selection
        # NVML's start can block on a sick GPU too: the agent says so and exits.
        inventory = call_with_deadline(
            lambda: open_inventory(selection, s.gpu_inventory_file), 30.0, "NVML's start"
        )
        self._monitor = GpuMonitor(
            inventory, selection, interval_s=s.gpu_poll_s, on_change=on_change
        ).start()
        self._memory = DeviceMemory(s.run_dir)
        gpus = self.gpus
        if gpus:
            log.info("GPUs: %s", ", ".join(_describe(g) for g in gpus))
        return self

    def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()

    @property
    def snapshot(self) -> GpuSnapshot:
        return self._monitor.snapshot if self._monitor is not None else GpuSnapshot()

    @property
    def gpus(self) -> tuple[GpuInfo, ...]:
        return self.snapshot.gpus

    def record_fields(self) -> dict[str, Any]:
        """The node record's slots and GPUs: a slot per healthy GPU on a GPU node."""
        gpus = self._pending = self.gpus
        if not gpus:
            return {"slots": self._settings.slots, "gpus": 0, "gpu_devices": []}
        return {
            "slots": sum(1 for g in gpus if g.healthy),
            "gpus": len(gpus),
            "gpu_devices": list(gpus),
        }

    @property
    def slots(self) -> int:
        """The node's worker slots now: its healthy GPUs, or ``--slots`` without GPUs."""
        gpus = self.gpus
        return sum(1 for g in gpus if g.healthy) if gpus else self._settings.slots

    def changed(self) -> bool:
        """Whether the GPUs' records differ from the ones last confirmed (:meth:`confirm`)."""
        return self.gpus != self._published

    def confirm(self) -> None:
        """The fields :meth:`record_fields` last gave are in the node record now."""
        self._published = self._pending

    def devices_for(
        self, job_id: str, count: int, held: Mapping[str, Collection[int]]
    ) -> list[int] | None:
        """The devices to give ``job_id`` now (see :func:`plan_devices`); None on a CPU
        node (nothing to set), [] for a job that asks for none on a GPU node.

        Raises:
            NoDevicesError: ``count`` healthy devices are not free now.
        """
        gpus = self.gpus
        if not gpus:
            if count:
                raise NoDevicesError(f"the job asks for {count} GPU(s); this node has none")
            return None
        previous = self._memory.last(job_id) if self._memory is not None else []
        chosen = plan_devices(gpus, held, job_id, count, previous)
        if chosen is None:
            free = sum(1 for g in gpus if g.healthy) - sum(
                len(d) for j, d in held.items() if j != job_id
            )
            raise NoDevicesError(
                f"the job asks for {count} GPU(s); {max(free, 0)} of this node's are free "
                "and healthy"
            )
        if self._memory is not None and chosen:
            self._memory.remember(job_id, chosen)
        return chosen

    def failed_holders(self, held: Mapping[str, Collection[int]]) -> dict[str, str]:
        """Jobs holding a failed GPU, each with why."""
        return failed_devices(self.gpus, held)


class NoDevicesError(RuntimeError):
    """A job cannot get the GPUs it asks for on this node now."""


def _describe(gpu: GpuInfo) -> str:
    where = f" numa {gpu.numa_node}" if gpu.numa_node is not None else ""
    if gpu.island is not None:
        where += f" nvlink {gpu.island}"
    state = "" if gpu.healthy else f" FAILED ({gpu.fault})"
    return f"{gpu.index} {gpu.model or '?'} {gpu.uuid}{where}{state}".replace("  ", " ")
