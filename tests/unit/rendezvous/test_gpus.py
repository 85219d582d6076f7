"""The GPU records in the node record and the capacity the coordinator reads (rendezvous.gpus)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from checkpoints.protocol.env import device_env
from rendezvous.gpus import GpuInfo, gpus_free
from rendezvous.records import Assignment
from rendezvous.registry import NodeInfo


def node(*healthy: bool) -> NodeInfo:
    devices = [GpuInfo(index=i, healthy=h, fault="" if h else "lost")
               for i, h in enumerate(healthy)]
    return NodeInfo(node_id="n", slots=sum(healthy), gpus=len(devices), gpu_devices=devices)


def test_gpus_counts_the_devices_and_healthy_gpus_the_offer() -> None:
    info = node(True, False, True)
    assert (info.gpus, info.healthy_gpus) == (3, 2)
    assert NodeInfo.from_json(info.to_json()) == info
    assert NodeInfo(node_id="old", gpus=8).healthy_gpus == 8  # a record without devices


def test_a_record_whose_count_and_devices_disagree_is_refused() -> None:
    with pytest.raises(ValidationError, match="must be the number of gpu_devices"):
        NodeInfo(node_id="n", gpus=1, gpu_devices=[GpuInfo(index=0), GpuInfo(index=1)])
    with pytest.raises(ValidationError, match="listed twice"):
        NodeInfo(node_id="n", gpus=2, gpu_devices=[GpuInfo(index=0), GpuInfo(index=0)])


def test_free_gpus_are_healthy_ones_no_assignment_asks_for() -> None:
    def assigned(gpus: int) -> Assignment:
        return Assignment(job_id="j", command=["x"], min_nodes=1, max_nodes=1,
                          gpus_per_node=gpus)

    info = node(True, True, True, False)
    placed = [{"n": assigned(2)}, {"other": assigned(4)}, {"n": assigned(0)}]
    assert gpus_free(info, "n", placed) == 1


def test_device_env_names_the_devices_in_nvml_order() -> None:
    assert device_env(None) == {}
    assert device_env([]) == {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert device_env([1, 3])["CUDA_VISIBLE_DEVICES"] == "1,3"
