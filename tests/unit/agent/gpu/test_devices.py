"""The device planner (agent.gpu.devices): which GPUs a job gets on a node.

Unit tests name the rules; a property test runs random histories of jobs
starting, stopping, restarting and GPUs failing against the one invariant
that matters: no device is ever given to two live jobs.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gpu.devices import DeviceMemory, failed_devices, plan_devices
from rendezvous.gpus import GpuInfo


def gpus(n: int, *, islands: int = 1, failed: tuple[int, ...] = ()) -> list[GpuInfo]:
    per = max(1, n // islands)
    return [
        GpuInfo(index=i, uuid=f"GPU-{i}", island=str(i // per) if islands > 1 else None,
                healthy=i not in failed, fault="XID 79" if i in failed else "")
        for i in range(n)
    ]


def test_a_job_gets_the_lowest_free_devices() -> None:
    assert plan_devices(gpus(4), {}, "a", 2) == [0, 1]
    assert plan_devices(gpus(4), {"b": [0, 1]}, "a", 2) == [2, 3]


def test_no_gpus_asked_is_an_empty_list() -> None:
    assert plan_devices(gpus(4), {"b": [0, 1, 2, 3]}, "a", 0) == []


def test_never_a_device_another_job_holds_nor_a_failed_one() -> None:
    assert plan_devices(gpus(4, failed=(2,)), {"b": [0]}, "a", 2) == [1, 3]
    assert plan_devices(gpus(4, failed=(2,)), {"b": [0]}, "a", 3) is None


def test_a_job_keeps_its_previous_devices_when_they_are_free() -> None:
    assert plan_devices(gpus(8), {}, "a", 2, previous=[5, 6]) == [5, 6]
    # Grown from 2 to 3: keeps both, adds the lowest free one.
    assert plan_devices(gpus(8), {}, "a", 3, previous=[5, 6]) == [0, 5, 6]
    # One of them taken meanwhile: keeps the other.
    assert plan_devices(gpus(8), {"b": [6]}, "a", 2, previous=[5, 6]) == [0, 5]


def test_its_own_devices_are_free_to_it_again() -> None:
    assert plan_devices(gpus(2), {"a": [0, 1]}, "a", 2, previous=[0, 1]) == [0, 1]


def test_one_nvlink_island_is_preferred_smallest_that_fits() -> None:
    # Islands {0,1,2,3} and {4,5,6,7}; 0 and 1 held: a 2-GPU job fits in {2,3}
    # (the smallest island with room), a 4-GPU job takes the whole free island.
    held = {"b": [0, 1]}
    assert plan_devices(gpus(8, islands=2), held, "a", 2) == [2, 3]
    assert plan_devices(gpus(8, islands=2), held, "a", 4) == [4, 5, 6, 7]


def test_spanning_islands_takes_the_largest_first() -> None:
    held = {"b": [0, 1, 2]}  # island 0 has 1 free, island 1 has 4
    assert plan_devices(gpus(8, islands=2), held, "a", 5) == [3, 4, 5, 6, 7]


def test_numa_nodes_stand_for_islands_without_nvlink() -> None:
    devices = [GpuInfo(index=i, numa_node=i // 2) for i in range(4)]
    assert plan_devices(devices, {"b": [0]}, "a", 2) == [2, 3]


def test_failed_devices_names_the_jobs_holding_them() -> None:
    assert failed_devices(gpus(4, failed=(1,)), {"a": [0, 1], "b": [2]}) == {
        "a": "GPU 1 failed: XID 79"
    }


def test_the_memory_survives_a_restart_and_ignores_a_bad_file(tmp_path: Path) -> None:
    memory = DeviceMemory(tmp_path)
    memory.remember("a", [2, 3])
    assert DeviceMemory(tmp_path).last("a") == [2, 3]
    (tmp_path / "devices.json").write_text("{not json")
    assert DeviceMemory(tmp_path).last("a") == []


# the property ------------------------------------------------------------------------

Op = tuple[str, int, int]  # (what, job number, count or GPU index)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 5), st.integers(0, 4)),
        st.tuples(st.just("stop"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("fail"), st.just(0), st.integers(0, 7)),
        st.tuples(st.just("agent_restart"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 4))
def test_no_device_is_ever_given_to_two_live_jobs(history: list[Op], islands: int) -> None:
    """Jobs start (a restart or resize is a stop and a start), stop, GPUs fail
    and the agent restarts (its runners die with it; only the memory is left)."""
    failed: set[int] = set()
    live: dict[str, list[int]] = {}
    memory: dict[str, list[int]] = {}
    for what, number, arg in history:
        job = f"job-{number}"
        if what == "start" and job not in live:
            node = gpus(8, islands=islands, failed=tuple(failed))
            chosen = plan_devices(node, live, job, arg, memory.get(job, []))
            if chosen is None:
                free = {g.index for g in node if g.healthy} - {i for d in live.values() for i in d}
                assert len(free) < arg
                continue
            assert len(chosen) == arg == len(set(chosen))
            assert not failed & set(chosen), "a failed device was given"
            previous = [i for i in memory.get(job, []) if i not in failed]
            taken = {i for d in live.values() for i in d}
            if len(previous) == arg and not taken & set(previous):
                assert chosen == sorted(previous), "a restart moved to other devices"
            live[job] = chosen
            memory[job] = chosen
        elif what == "stop":
            live.pop(job, None)
        elif what == "fail":
            failed.add(arg)
            for holder in failed_devices(gpus(8, failed=tuple(failed)), live):
                live.pop(holder)  # the job loses the node
        elif what == "agent_restart":
            live.clear()
        owners: dict[int, str] = {}
        for holder, devices in live.items():
            for i in devices:
                assert i not in owners, f"GPU {i} given to {owners[i]} and {holder}"
                owners[i] = holder
