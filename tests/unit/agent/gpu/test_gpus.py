"""The agent's GPU inventory (agent.gpu.nvml), its node-level wrapper and its metrics."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.gpu.metrics import GpuCollector
from agent.gpu.nvml import (
    DeadlineError,
    FileInventory,
    GpuInventoryError,
    GpuMonitor,
    GpuSnapshot,
    StaticInventory,
    call_with_deadline,
    open_inventory,
    parse_selection,
    select,
)
from agent.node.gpus import NodeGpus, NoDevicesError
from agent.node.settings import AgentSettings
from rendezvous.gpus import GpuInfo


def write_inventory(path: Path, *, failed: dict[int, str] | None = None, n: int = 4) -> Path:
    failed = failed or {}
    path.write_text(json.dumps({"gpus": [
        {"index": i, "uuid": f"GPU-{i}", "model": "Fake H100", "memory_bytes": 80 << 30,
         "numa_node": i // 2, "healthy": i not in failed, "fault": failed.get(i, ""),
         "utilization_pct": 50.0, "memory_used_bytes": 1 << 30, "power_w": 300.0,
         "temperature_c": 60.0}
        for i in range(n)
    ]}))
    return path


@pytest.mark.parametrize(("text", "parsed"), [
    ("all", None), ("none", []), ("", []), ("3,0,1", [0, 1, 3]), (" 2 ", [2]),
])
def test_selection_parses_all_none_and_indices(text: str, parsed: list[int] | None) -> None:
    assert parse_selection(text) == parsed


@pytest.mark.parametrize("text", ["0,0", "a", "-1", "1,,2", "4096"])
def test_a_bad_selection_is_refused_with_its_value(text: str) -> None:
    with pytest.raises(ValueError, match="--gpus"):
        parse_selection(text)


def test_settings_refuse_a_bad_gpus_value() -> None:
    with pytest.raises(ValueError, match="--gpus"):
        AgentSettings(gpus="0,x")


def test_explicit_indices_are_offered_bare_where_the_inventory_lists_none() -> None:
    picked = select(GpuSnapshot(), [0, 5])
    assert [(g.index, g.uuid, g.healthy) for g in picked.gpus] == [(0, "", True), (5, "", True)]
    snap = GpuSnapshot((GpuInfo(index=0, uuid="GPU-0"), GpuInfo(index=1, uuid="GPU-1")))
    assert [g.uuid for g in select(snap, [1]).gpus] == ["GPU-1"]


def test_an_index_the_machine_does_not_have_is_refused() -> None:
    snap = GpuSnapshot(tuple(GpuInfo(index=i) for i in range(8)))
    with pytest.raises(GpuInventoryError, match="8, which this machine does not have"):
        select(snap, [8])


def test_without_nvml_explicit_indices_are_a_static_inventory() -> None:
    inventory = open_inventory([1, 2], None)
    assert [g.index for g in inventory.poll().gpus] == [1, 2]
    assert open_inventory([], None).poll().gpus == ()


def test_the_inventory_file_gives_records_and_readings(tmp_path: Path) -> None:
    inventory = FileInventory(write_inventory(tmp_path / "gpus.json", failed={3: "XID 79"}))
    snap = inventory.poll()
    assert [g.healthy for g in snap.gpus] == [True, True, True, False]
    assert snap.gpus[3].fault == "XID 79" and snap.gpus[1].numa_node == 0
    assert snap.readings[0].power_w == 300.0


def test_a_bad_inventory_file_is_an_inventory_error(tmp_path: Path) -> None:
    (tmp_path / "gpus.json").write_text('{"gpus": [{"index": 0}, {"index": 0}]}')
    with pytest.raises(GpuInventoryError, match="listed twice"):
        FileInventory(tmp_path / "gpus.json").poll()


def test_a_call_past_its_deadline_is_abandoned() -> None:
    release = threading.Event()

    def hang() -> GpuSnapshot:
        release.wait(10)
        return GpuSnapshot()

    with pytest.raises(DeadlineError, match="did not answer within"):
        call_with_deadline(hang, 0.05, "the hung poll")
    release.set()


def test_the_monitor_notices_a_gpu_that_fails(tmp_path: Path) -> None:
    path = write_inventory(tmp_path / "gpus.json")
    changed = threading.Event()
    monitor = GpuMonitor(FileInventory(path), None, interval_s=0.02,
                         on_change=changed.set).start()
    try:
        assert all(g.healthy for g in monitor.snapshot.gpus)
        write_inventory(path, failed={2: "3 uncorrectable ECC error(s)"})
        assert changed.wait(5), "the monitor did not notice the change"
        assert not monitor.snapshot.gpus[2].healthy
    finally:
        monitor.stop()


def test_node_gpus_offer_a_slot_per_healthy_gpu_and_pick_devices(tmp_path: Path) -> None:
    path = write_inventory(tmp_path / "gpus.json", failed={0: "XID 48"})
    node = NodeGpus(AgentSettings(run_dir=tmp_path, gpu_inventory_file=path, slots=7))
    node.start(on_change=lambda: None)
    try:
        fields = node.record_fields()
        assert (fields["slots"], fields["gpus"], node.slots) == (3, 4, 3)
        assert node.devices_for("a", 2, {}) == [2, 3]  # one NUMA node: 2 and 3
        with pytest.raises(NoDevicesError, match="asks for 2 GPU"):
            node.devices_for("b", 2, {"a": [2, 3]})
        assert node.failed_holders({"a": [0, 1]}) == {"a": "GPU 0 failed: XID 48"}
    finally:
        node.stop()


def test_a_cpu_node_sets_no_devices_and_refuses_gpu_jobs(tmp_path: Path) -> None:
    node = NodeGpus(AgentSettings(run_dir=tmp_path, gpus="none", slots=2))
    node.start(on_change=lambda: None)
    assert node.record_fields() == {"slots": 2, "gpus": 0, "gpu_devices": []}
    assert node.devices_for("a", 0, {}) is None
    with pytest.raises(NoDevicesError, match="has none"):
        node.devices_for("a", 1, {})


def test_metrics_label_each_gpu_with_its_node_and_job(tmp_path: Path) -> None:
    snap = FileInventory(write_inventory(tmp_path / "gpus.json", failed={3: "x"})).poll()
    registry = CollectorRegistry()
    registry.register(GpuCollector("n1", lambda: snap, lambda: {"job-a": [1]}))
    text = generate_latest(registry).decode()
    assert 'tidal_agent_gpu_utilization_ratio{gpu="1",job_id="job-a",node_id="n1"} 0.5' in text
    assert 'tidal_agent_gpu_job{gpu="1",job_id="job-a",node_id="n1"} 1.0' in text
    assert 'tidal_agent_gpu_healthy{gpu="3",node_id="n1"} 0.0' in text
    assert 'tidal_agent_gpu_power_watts{gpu="0",job_id="",node_id="n1"} 300.0' in text


def test_a_static_inventory_never_changes() -> None:
    inventory = StaticInventory([0])
    assert inventory.poll() == inventory.poll()
