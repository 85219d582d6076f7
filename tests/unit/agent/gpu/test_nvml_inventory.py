"""NvmlInventory's reading of NVML, against a stand-in ``pynvml`` module (no GPU here):
records, NVLink islands, readings, and the three ways a GPU fails (lost, ECC, XID)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.gpu.nvml import NvmlInventory


class NVMLError(Exception):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


@dataclass
class FakeGpu:
    index: int
    links: list[int] = field(default_factory=list)  # NVLink peers' indices
    ecc: int = 0
    lost: bool = False


def fake_nvml(gpus: list[FakeGpu], xids: list[tuple[int, int]]) -> types.ModuleType:
    """A ``pynvml`` with ``gpus``; ``xids``: (gpu index, XID) events pending."""
    nvml: Any = types.ModuleType("pynvml")
    nvml.NVMLError, nvml.NVMLError_GpuIsLost = NVMLError, NVMLError_GpuIsLost
    nvml.NVML_NVLINK_MAX_LINKS, nvml.NVML_FEATURE_ENABLED = 4, 1
    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC = 1, 0
    nvml.NVML_TEMPERATURE_GPU, nvml.nvmlEventTypeXidCriticalError = 0, 8
    ns = types.SimpleNamespace

    def handle(i: int) -> FakeGpu:
        if gpus[i].lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return gpus[i]

    def link(gpu: FakeGpu, n: int) -> int:
        if n >= len(gpu.links):
            raise NVMLError("no such link")
        return 1

    def wait(_events: object, _ms: int) -> Any:
        if not xids:
            raise NVMLError_Timeout("timeout")
        index, xid = xids.pop(0)
        return ns(device=gpus[index], eventData=xid)

    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlEventSetCreate = lambda: object()
    nvml.nvmlEventSetFree = lambda _s: None
    nvml.nvmlDeviceRegisterEvents = lambda _h, _t, _s: None
    nvml.nvmlEventSetWait = wait
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetUUID = lambda g: f"GPU-{g.index}".encode()
    nvml.nvmlDeviceGetName = lambda _g: b"Fake H100"
    nvml.nvmlDeviceGetMemoryInfo = lambda _g: ns(total=80 << 30, used=1 << 30)
    nvml.nvmlDeviceGetPciInfo = lambda g: ns(busId=f"00000000:{g.index + 16:02x}:00.0")
    nvml.nvmlDeviceGetNvLinkState = link
    nvml.nvmlDeviceGetNvLinkRemotePciInfo = lambda g, n: ns(
        busId=f"00000000:{g.links[n] + 16:02x}:00.0")
    nvml.nvmlDeviceGetTotalEccErrors = lambda g, _t, _c: g.ecc
    nvml.nvmlDeviceGetUtilizationRates = lambda _g: ns(gpu=42)
    nvml.nvmlDeviceGetPowerUsage = lambda _g: 250_000  # mW
    nvml.nvmlDeviceGetTemperature = lambda _g, _s: 61
    return nvml  # type: ignore[no-any-return]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[FakeGpu], list[Any]]]:
    # Two NVLink islands: {0, 1} and {2, 3}.
    gpus = [FakeGpu(0, [1]), FakeGpu(1, [0]), FakeGpu(2, [3]), FakeGpu(3, [2])]
    xids: list[tuple[int, int]] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus, xids))
    yield gpus, xids


def test_records_islands_and_readings(machine: tuple[list[FakeGpu], list[Any]]) -> None:
    snap = NvmlInventory().poll()
    assert [(g.index, g.uuid, g.island) for g in snap.gpus] == [
        (0, "GPU-0", "0"), (1, "GPU-1", "0"), (2, "GPU-2", "2"), (3, "GPU-3", "2")]
    assert snap.gpus[0].model == "Fake H100" and snap.gpus[0].memory_bytes == 80 << 30
    reading = snap.readings[1]
    assert (reading.utilization_pct, reading.power_w, reading.temperature_c) == (42, 250, 61)
    assert all(g.healthy for g in snap.gpus)


def test_gpus_behind_nvswitches_are_one_island(monkeypatch: pytest.MonkeyPatch) -> None:
    # Peer 99 is no GPU: an NVSwitch. GPUs 0-2 hang off switches, GPU 3 has no NVLink.
    gpus = [FakeGpu(0, [99]), FakeGpu(1, [99, 99]), FakeGpu(2, [99]), FakeGpu(3)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus, []))
    assert [g.island for g in NvmlInventory().poll().gpus] == ["0", "0", "0", "3"]


def test_a_lost_gpu_an_ecc_error_and_a_fatal_xid_fail_for_good(
    machine: tuple[list[FakeGpu], list[Any]],
) -> None:
    gpus, xids = machine
    inventory = NvmlInventory()
    gpus[0].lost = True
    gpus[1].ecc = 2
    xids += [(2, 13), (3, 79)]  # 13: the program's fault, not the GPU's; 79: off the bus
    snap = inventory.poll()
    faults = {g.index: g.fault for g in snap.gpus if not g.healthy}
    assert faults == {0: "lost: the GPU fell off the bus",
                      1: "2 uncorrectable ECC error(s)", 3: "XID 79 reported by the driver"}
    assert 0 not in snap.readings and 2 in snap.readings
    gpus[0].lost, gpus[1].ecc = False, 0
    assert {g.index for g in inventory.poll().gpus if not g.healthy} == {0, 1, 3}  # sticky
