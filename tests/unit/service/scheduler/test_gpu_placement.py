"""GPU jobs: the spec's gpus_per_node and where the scheduler places them (free healthy GPUs)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rendezvous.gpus import GpuInfo
from rendezvous.records import Assignment
from rendezvous.registry import NodeInfo
from service.api.models import JobRecord, JobSpec
from service.scheduler import ClusterView, plan

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def gpu_node(node_id: str, n: int, *, failed: tuple[int, ...] = ()) -> NodeInfo:
    devices = [GpuInfo(index=i, healthy=i not in failed) for i in range(n)]
    return NodeInfo(node_id=node_id, slots=n - len(failed), gpus=n, gpu_devices=devices,
                    started_at=T0, version="test")


def gpu_job(job_id: str, gpus: int, *, created: int = 0, nodes: int = 1) -> JobRecord:
    spec = JobSpec(name=job_id, command=["python", "train.py"], gpus_per_node=gpus,
                   min_nodes=nodes, max_nodes=nodes)
    return JobRecord(job_id=job_id, spec=spec, created_at=T0 + timedelta(seconds=created),
                     next_event=1)


def placed(view: ClusterView) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for change in plan(view, T0 + timedelta(minutes=1)):
        if change.put:
            out[change.job_id] = set(change.put)
    return out


def test_nproc_per_node_defaults_to_gpus_per_node() -> None:
    assert JobSpec(name="a", command=["x"], gpus_per_node=4).nproc_per_node == 4
    assert JobSpec(name="a", command=["x"], gpus_per_node=4, nproc_per_node=1).nproc_per_node == 1
    assert JobSpec.model_validate_json(
        '{"name": "a", "command": ["x"], "gpus_per_node": 2}').nproc_per_node == 2
    assert JobSpec(name="a", command=["x"]).gpus_per_node == 0


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"])
def test_a_job_cannot_set_its_own_devices(name: str) -> None:
    with pytest.raises(ValidationError, match=f"{name} is set by tidal"):
        JobSpec(name="a", command=["x"], env={name: "0"})


def test_the_assignment_carries_the_gpus() -> None:
    view = ClusterView(jobs={"a": gpu_job("a", 2)}, nodes={"n": gpu_node("n", 4)})
    [change] = plan(view, T0)
    assert change.put["n"].gpus_per_node == 2 and change.put["n"].nproc_per_node == 2


def test_two_jobs_share_a_node_only_while_its_gpus_last() -> None:
    jobs = {j.job_id: j for j in (gpu_job("a", 2), gpu_job("b", 2, created=1),
                                  gpu_job("c", 1, created=2))}
    view = ClusterView(jobs=jobs, nodes={"n": gpu_node("n", 4)})
    assert placed(view) == {"a": {"n"}, "b": {"n"}}  # c waits: no GPU left


def test_a_failed_gpu_is_not_offered() -> None:
    view = ClusterView(jobs={"a": gpu_job("a", 4)},
                       nodes={"n": gpu_node("n", 4, failed=(1,)), "m": gpu_node("m", 4)})
    assert placed(view) == {"a": {"m"}}


def test_a_gpu_job_never_lands_on_a_cpu_node() -> None:
    cpu = NodeInfo(node_id="cpu", slots=8, started_at=T0, version="test")
    view = ClusterView(jobs={"a": gpu_job("a", 1)}, nodes={"cpu": cpu})
    assert placed(view).get("a", set()) == set()


def test_gpus_asked_by_other_nodes_jobs_do_not_count() -> None:
    jobs = {"a": gpu_job("a", 3, nodes=2), "b": gpu_job("b", 1, created=1)}
    view = ClusterView(jobs=jobs, nodes={"n": gpu_node("n", 4), "m": gpu_node("m", 4)})
    result = placed(view)
    assert result["a"] == {"n", "m"} and len(result["b"]) == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 3)), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), min_size=1, max_size=8),
)
def test_no_node_is_asked_for_more_gpus_than_it_has_healthy(
    node_specs: list[tuple[int, int]], job_specs: list[tuple[int, int]]
) -> None:
    """Over two passes (the second sees the first's assignments), the GPUs the
    assignments on each node ask for never exceed its healthy GPUs."""
    nodes = {}
    for i, (n, failed) in enumerate(node_specs):
        if n:
            nodes[f"n{i}"] = gpu_node(f"n{i}", n, failed=tuple(range(min(failed, n))))
        else:
            nodes[f"n{i}"] = NodeInfo(node_id=f"n{i}", slots=4, started_at=T0, version="test")
    jobs = {f"j{i}": gpu_job(f"j{i}", gpus, created=i, nodes=count)
            for i, (gpus, count) in enumerate(job_specs)}
    assignments: dict[str, dict[str, Assignment]] = {}
    for _ in range(2):
        view = ClusterView(jobs=jobs, nodes=nodes, assignments=assignments)
        for change in plan(view, T0 + timedelta(minutes=1)):
            per_node = assignments.setdefault(change.job_id, {})
            per_node.update(change.put)
            for node_id in change.delete:
                per_node.pop(node_id, None)
            jobs[change.job_id] = change.record
        for node_id, info in nodes.items():
            asked = sum(per[node_id].gpus_per_node for per in assignments.values()
                        if node_id in per)
            assert asked <= info.healthy_gpus, (node_id, asked, info.healthy_gpus)
