"""tidal up --gpus-per-agent: each local agent gets its own run of device indices."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.up.cluster import LocalCluster


def gpus_flag(cluster: LocalCluster, node_id: str, tmp_path: Path) -> str | None:
    argv = cluster._gpus_argv(node_id)  # the part of the agent's argv it adds
    return argv[argv.index("--gpus") + 1] if "--gpus" in argv else None


def test_each_agent_gets_its_own_indices(tmp_path: Path) -> None:
    cluster = LocalCluster(state_dir=tmp_path, agents=2, gpus_per_agent=2)
    assert gpus_flag(cluster, "node-1", tmp_path) == "0,1"
    assert gpus_flag(cluster, "node-2", tmp_path) == "2,3"


def test_without_the_option_agents_find_their_gpus(tmp_path: Path) -> None:
    assert gpus_flag(LocalCluster(state_dir=tmp_path), "node-1", tmp_path) is None
    cluster = LocalCluster(state_dir=tmp_path, gpus_per_agent=0)
    assert gpus_flag(cluster, "node-1", tmp_path) == "none"


def test_an_out_of_range_count_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gpus_per_agent"):
        LocalCluster(state_dir=tmp_path, gpus_per_agent=65)
