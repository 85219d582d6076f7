"""A node record's GPUs in a real etcd: published at registration, updated under the lease."""

from __future__ import annotations

from rendezvous.etcd import EtcdClient
from rendezvous.gpus import GpuInfo
from rendezvous.registry import NodeInfo, NodeRegistry


def test_a_changed_gpu_record_is_published_under_the_same_lease(etcd_client: EtcdClient) -> None:
    registry = NodeRegistry(etcd_client)
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", model="H100", numa_node=0, island="0")
            for i in range(2)]
    info = NodeInfo(node_id="g", slots=2, gpus=2, gpu_devices=gpus)
    registration = registry.register(info, ttl_s=3)
    try:
        assert registry.get("g") == info
        lease = registration.lease_id
        failed = gpus[1].model_copy(update={"healthy": False, "fault": "XID 79"})
        changed = info.model_copy(update={"slots": 1, "gpu_devices": [gpus[0], failed]})
        assert registration.update(changed)
        got = registry.get("g")
        assert got is not None and got.healthy_gpus == 1 and got.gpu_devices[1].fault == "XID 79"
        kv = etcd_client.get(etcd_client.keys.node("g"))
        assert kv is not None and kv.lease == lease == registration.lease_id
    finally:
        registration.deregister()
    assert not registration.update(changed)  # no lease: kept for a re-registration
