"""Fixtures the e2e tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.etcd_server import EtcdServer
from tests.support.agents import AgentCluster
from tests.support.coordinator import CoordinatorProcess, coordinator_and_agents
from tests.support.processes import ProcessGroupRegistry


@pytest.fixture
def cluster(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    """A started coordinator and an (empty) agent cluster on the session's etcd; a module
    that needs another kind of cluster defines its own ``cluster``."""
    with coordinator_and_agents(
        tmp_path=tmp_path, etcd_server=etcd_server, etcd_root=etcd_root, procs=procs
    ) as both:
        yield both
