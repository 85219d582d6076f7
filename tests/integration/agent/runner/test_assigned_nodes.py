"""Whom a job's rendezvous round waits for (agent.runner.setup.assigned_nodes), on a real etcd."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.runner.setup import assigned_nodes
from rendezvous.etcd import EtcdClient
from rendezvous.records import Assignment
from rendezvous.registry import NodeInfo, NodeRegistration, NodeRegistry
from tests.support.agents import assign, assign_by_hand

JOB = Assignment(job_id="ranks", command=["python", "-c", "pass"], min_nodes=1, max_nodes=3)


@pytest.fixture
def registered(etcd_client: EtcdClient) -> Iterator[list[NodeRegistration]]:
    """Nodes a, b, c and forged alive (registered under a lease), as their agents would be."""
    registry = NodeRegistry(etcd_client)
    held = [registry.register(NodeInfo(node_id=node, host="h", address="127.0.0.1", slots=1),
                              ttl_s=10)
            for node in ("a", "b", "c", "forged")]
    try:
        yield held
    finally:
        for registration in held:
            registration.deregister()


def test_a_round_waits_for_the_nodes_the_job_record_names_not_any_assignment_key(
    etcd_client: EtcdClient, registered: list[NodeRegistration]
) -> None:
    keys = etcd_client.keys
    assign(etcd_client, "a", JOB)
    assign(etcd_client, "b", JOB.model_copy(update={"generation": 2}))
    # Written by someone who can write to etcd, not by the coordinator: the
    # node's agent never runs it, so a round must not wait for that node.
    assign_by_hand(etcd_client, "forged", JOB)
    assert assigned_nodes(etcd_client, keys, "ranks") == {"a", "b"}


def test_a_node_the_record_names_counts_once_it_is_registered(
    etcd_client: EtcdClient, registered: list[NodeRegistration]
) -> None:
    keys = etcd_client.keys
    assign(etcd_client, "a", JOB)
    assign(etcd_client, "gone", JOB)  # placed, but its agent's lease is gone
    assert assigned_nodes(etcd_client, keys, "ranks") == {"a"}


def test_a_job_without_a_record_waits_for_nobody(
    etcd_client: EtcdClient, registered: list[NodeRegistration]
) -> None:
    assign_by_hand(etcd_client, "a", JOB)
    assign_by_hand(etcd_client, "b", JOB)
    assert assigned_nodes(etcd_client, etcd_client.keys, "ranks") == set()
