"""A failed GPU takes its jobs off the node, GPUs not free make a job wait or leave
(agent.node.offer); the daemon's part end to end: tests/e2e/test_gpus.py."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from agent.node.gpus import NodeGpus
from agent.node.offer import NodeOffer, evictions, held_devices, left_status, waits_for_devices
from agent.node.settings import AgentSettings
from rendezvous.records import RUNNER_RANK, Assignment, JobNodeState, JobNodeStatus
from tests.unit.agent.fakes import FakeEtcd
from tests.unit.agent.gpu.test_gpus import write_inventory

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


class FakeProcess:
    def __init__(self) -> None:
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1


@dataclass
class Runner:
    assignment: Assignment
    process: FakeProcess
    stop_deadline: float | None = None
    devices: list[int] | None = None


def job(job_id: str, generation: int = 1) -> Assignment:
    return Assignment(job_id=job_id, generation=generation, command=["true"], min_nodes=1,
                      max_nodes=2)


def runner(job_id: str, devices: list[int] | None, *, stopping: bool = False) -> Runner:
    return Runner(job(job_id), FakeProcess(), 1.0 if stopping else None, devices)


def test_a_failed_gpu_evicts_each_of_its_jobs_once_with_its_generation() -> None:
    failed = {"a": "GPU 0 failed: XID 79", "b": "GPU 1 failed: XID 48"}
    assert evictions(failed, {"a": 3, "b": 1}, evicted={"b"}) == {
        "a": (3, "GPU 0 failed: XID 79")}
    assert evictions({}, {"a": 3}, evicted=()) == {}


def test_a_job_waits_for_gpus_only_while_a_stopping_runner_holds_some() -> None:
    assert waits_for_devices([runner("a", [0], stopping=True)])
    assert not waits_for_devices([runner("a", [0])])  # running: nothing comes free
    assert not waits_for_devices([runner("a", None, stopping=True)])  # a CPU node's
    assert not waits_for_devices([])


def test_only_runners_with_devices_hold_any() -> None:
    runners = {"a": runner("a", [1, 2]), "b": runner("b", None), "c": runner("c", [])}
    assert held_devices(runners) == {"a": [1, 2]}


def test_leaving_keeps_what_the_same_generation_reported_and_says_why() -> None:
    reported = JobNodeStatus(job_id="a", node_id="n", generation=2, state=JobNodeState.RUNNING,
                             world_size=4, devices=[0])
    left = left_status(job("a", 2), "n", "GPU 0 failed", reported, NOW)
    assert (left.state, left.world_size, left.devices, left.updated_at) == (
        JobNodeState.CANCELLED, 4, [0], NOW)
    assert left.error is not None
    assert (left.error.rank, left.error.message) == (RUNNER_RANK, "GPU 0 failed")


def test_leaving_another_generation_starts_from_a_fresh_status_and_caps_the_reason() -> None:
    reported = JobNodeStatus(job_id="a", node_id="n", generation=1, state=JobNodeState.RUNNING,
                             world_size=4)
    left = left_status(job("a", 2), "n", "x" * 5000, reported, NOW)
    assert (left.generation, left.world_size, left.state) == (2, 0, JobNodeState.CANCELLED)
    assert left.error is not None and len(left.error.message) == 4096


def test_a_runner_on_a_failed_gpu_is_killed_once_and_its_job_leaves(tmp_path: Path) -> None:
    path = write_inventory(tmp_path / "gpus.json", failed={1: "XID 79"})
    gpus = NodeGpus(AgentSettings(node_id="n", run_dir=tmp_path, gpu_inventory_file=path))
    gpus.start(on_change=lambda: None)
    try:
        offer = NodeOffer(AgentSettings(node_id="n", run_dir=tmp_path), gpus)
        runners = {"a": runner("a", [0, 1]), "b": runner("b", [2])}
        offer.evict(runners)
        offer.evict(runners)
        assert (runners["a"].process.kills, runners["b"].process.kills) == (1, 0)
        assert runners["a"].stop_deadline is not None and runners["b"].stop_deadline is None
        assert offer.eviction(job("a", 2)) is None  # another generation was not evicted
        assert offer.eviction(job("a")) == "GPU 1 failed: XID 79"
        client = FakeEtcd()
        offer.leave(client, job("a"), "GPU 1 failed: XID 79")  # type: ignore[arg-type]
        assert client.status("a", "n").state == JobNodeState.CANCELLED
        assert offer.eviction(job("a")) is None
    finally:
        gpus.stop()
