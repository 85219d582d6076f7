"""The node registry against a real etcd: register, list, expire, survive, refuse."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.registry import NodeAlreadyRegisteredError, NodeInfo, NodeRegistry
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

# A node whose keep-alive stops must be gone within its TTL plus this (issue bound).
EXPIRY_MARGIN_S = 1.0

CHILD = """
import sys, time
from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.registry import NodeInfo, NodeRegistry
endpoint, root, node_id, ttl = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = create_client(EtcdConfig(endpoints=[endpoint], timeout_s=2.0, root=root))
NodeRegistry(client).register(NodeInfo(node_id=node_id, slots=2), ttl_s=ttl)
print("registered", flush=True)
while True:
    time.sleep(60)
"""


class Membership:
    """on_join / on_leave callbacks that keep the set of live node ids."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.joins: list[str] = []
        self.leaves: list[str] = []
        self.lock = threading.Lock()

    def on_join(self, info: NodeInfo) -> None:
        with self.lock:
            self.live.add(info.node_id)
            self.joins.append(info.node_id)

    def on_leave(self, node_id: str) -> None:
        with self.lock:
            self.live.discard(node_id)
            self.leaves.append(node_id)


@pytest.fixture
def registry(etcd_client: EtcdClient) -> NodeRegistry:
    return NodeRegistry(etcd_client)


def test_register_list_and_deregister(registry: NodeRegistry, etcd_client: EtcdClient) -> None:
    info = NodeInfo(node_id="node-1", address="10.0.0.1", slots=4, gpus=2, labels={"zone": "a"})
    registration = registry.register(info, ttl_s=3)
    try:
        assert registry.list_nodes() == [info]
        assert registry.get("node-1") == info
        kv = etcd_client.get(etcd_client.keys.node("node-1"))
        assert kv is not None and kv.lease == registration.lease_id != 0
        assert json.loads(kv.value)["slots"] == 4  # JSON, never pickle
    finally:
        registration.deregister()
    assert registry.list_nodes() == []
    assert registry.get("node-1") is None
    assert not registration.registered


def test_a_duplicate_node_id_is_refused_while_its_holder_lives(registry: NodeRegistry) -> None:
    with registry.register(NodeInfo(node_id="twin"), ttl_s=3):
        with pytest.raises(NodeAlreadyRegisteredError, match="'twin' is already registered"):
            registry.register(NodeInfo(node_id="twin", address="10.0.0.2"), ttl_s=3)
        assert registry.get("twin").address == "127.0.0.1"  # type: ignore[union-attr]
    # Once the holder is gone, the id is free again.
    with registry.register(NodeInfo(node_id="twin", address="10.0.0.2"), ttl_s=3):
        assert registry.get("twin").address == "10.0.0.2"  # type: ignore[union-attr]


def test_a_node_whose_keep_alive_stops_disappears_within_its_ttl(
    registry: NodeRegistry,
) -> None:
    registration = registry.register(NodeInfo(node_id="quiet"), ttl_s=2)
    registration.close(revoke=False)  # keep-alives stop; the lease is left to expire
    stopped = time.monotonic()
    wait_for(
        lambda: registry.get("quiet") is None,
        timeout=2 + EXPIRY_MARGIN_S + 2,
        what="the node to disappear",
    )
    elapsed = time.monotonic() - stopped
    assert elapsed <= 2 + EXPIRY_MARGIN_S, f"node disappeared after {elapsed:.2f} s"


def test_a_sigkilled_agent_process_disappears_within_its_ttl(
    registry: NodeRegistry,
    etcd_config: EtcdConfig,
    procs: ProcessGroupRegistry,
    tmp_path: Path,
) -> None:
    ttl = 2
    log_path = tmp_path / "child.log"
    argv = [sys.executable, "-c", CHILD, etcd_config.endpoints[0], etcd_config.root, "k9", str(ttl)]
    child = procs.spawn(argv, log_path=log_path)

    def registered() -> bool:
        if child.poll() is not None:
            raise AssertionError(f"the child exited: {log_path.read_text()}")
        return registry.get("k9") is not None

    wait_for(registered, timeout=20, what="the child to register node k9")
    procs.kill_group(child)
    killed = time.monotonic()
    assert child.poll() is not None
    wait_for(lambda: registry.get("k9") is None, timeout=ttl + 4, what="k9 to disappear")
    elapsed = time.monotonic() - killed
    assert elapsed <= ttl + EXPIRY_MARGIN_S, f"k9 disappeared {elapsed:.2f} s after SIGKILL"


def test_watch_nodes_reports_joins_and_leaves(registry: NodeRegistry) -> None:
    first = registry.register(NodeInfo(node_id="n1"), ttl_s=3)
    members = Membership()
    watcher = registry.watch_nodes(members.on_join, members.on_leave)
    try:
        wait_for(lambda: members.live == {"n1"}, timeout=5, what="the existing node n1")
        second = registry.register(NodeInfo(node_id="n2"), ttl_s=3)
        wait_for(lambda: members.live == {"n1", "n2"}, timeout=5, what="n2 to join")
        first.deregister()
        wait_for(lambda: members.live == {"n2"}, timeout=5, what="n1 to leave")
        second.deregister()
        wait_for(lambda: members.live == set(), timeout=5, what="n2 to leave")
        assert members.joins == ["n1", "n2"] and members.leaves == ["n1", "n2"]
    finally:
        watcher.stop()


@pytest.fixture
def restart_client(fresh_etcd: EtcdServer) -> Iterator[EtcdClient]:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=1.0, root="/tidal-registry")
    client = create_client(config)
    try:
        yield client
    finally:
        client.close()


def test_an_etcd_outage_longer_than_the_ttl_is_survived_by_registering_again(
    fresh_etcd: EtcdServer, restart_client: EtcdClient
) -> None:
    client = restart_client
    registry = NodeRegistry(client)
    info = NodeInfo(node_id="survivor", slots=8)
    registration = registry.register(info, ttl_s=2)
    members = Membership()
    watcher = registry.watch_nodes(members.on_join, members.on_leave)
    try:
        wait_for(lambda: members.live == {"survivor"}, timeout=5, what="the watcher to see it")
        old_lease = registration.lease_id
        fresh_etcd.kill()
        # Down for longer than the TTL: the registration's lease is lost by its
        # own clock, and it keeps trying to register again.
        wait_for(lambda: not registration.registered, timeout=10, what="the lease to be lost")
        fresh_etcd.start()
        wait_for(lambda: registration.registered, timeout=15, what="the node to register again")
        assert registration.lease_id != old_lease and registration.registrations == 2
        kv = client.get(client.keys.node("survivor"))
        assert kv is not None and kv.lease == registration.lease_id
        assert registry.get("survivor") == info  # the same record
        # The restored old lease (etcd gives it a full TTL again) was revoked.
        assert client.lease_ttl(old_lease) == -1
        wait_for(lambda: watcher.relists >= 1, timeout=10, what="the watcher to re-list")
        key = client.keys.node("survivor")
        wait_for(
            lambda: watcher.snapshot()[key].lease == registration.lease_id,
            timeout=10,
            what="the watcher to see the node under its new lease",
        )
        # The restored old lease kept the key until the new one took it over:
        # the node was never falsely reported gone.
        assert members.live == {"survivor"} and members.leaves == []
        assert [node.node_id for node in registry.list_nodes()] == ["survivor"]
        # It stays registered: its new keep-alive works.
        assert not registration._keeper.wait_lost(timeout=3)  # type: ignore[union-attr]
        assert registry.get("survivor") == info
    finally:
        watcher.stop()
        registration.deregister()
    assert client.get(client.keys.node("survivor")) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"node_id": "../x"}, "node id '../x' is not valid"),
        ({"node_id": ""}, "node id '' is not valid"),
        ({"node_id": "n", "slots": -1}, "greater than or equal to 0"),
        ({"node_id": "n", "gpus": -1}, "greater than or equal to 0"),
        ({"node_id": "n", "host": "a b"}, "is not a host name"),
        ({"node_id": "n", "labels": {"bad key": "v"}}, "label key 'bad key'"),
        ({"node_id": "n", "labels": {"k": "v" * 129}}, "label 'k' has value"),
        ({"node_id": "n", "labels": {f"k{i}": "v" for i in range(33)}}, "at most 32 labels"),
        ({"node_id": "n", "extra": 1}, "Extra inputs are not permitted"),
    ],
)
def test_node_info_rejects_bad_fields_naming_the_value(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        NodeInfo(**fields)  # type: ignore[arg-type]


def test_node_info_round_trips_through_json() -> None:
    info = NodeInfo(node_id="n", labels={"gpu.type": "h100", "zone": "eu-1"}, gpus=8)
    assert NodeInfo.from_json(info.to_json()) == info
    assert info.version and info.started_at.tzinfo is not None
