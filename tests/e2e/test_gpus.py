"""GPUs through the whole service, on a machine without GPUs: agents given
device indices (``--gpus 0,1,2,3``, or a JSON inventory standing for NVML),
a real coordinator, real runners and real worker processes that write down
the environment they were started with.

* two jobs of 2 GPUs on one 4-GPU node run side by side with disjoint
  ``CUDA_VISIBLE_DEVICES`` (each worker sees its job's pair); a third waits;
  the API shows each job's devices; a job restarted with new bounds keeps its
  devices;
* a GPU that fails under a job (the inventory file rewritten) is taken out of
  the node's offer and the job loses the node as if it died: it comes back on
  healthy devices only, and ``tidal nodes`` says why the GPU is out; after the
  agent is SIGKILLed and started again, the job gets the same devices back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.agents import AgentCluster
from tests.support.coordinator import TOKEN, CoordinatorProcess, job_view
from tests.support.wait import wait_for

# First starts wait up to 300 s: a runner's and its workers' imports took over 180 s
# on the 2-core machine at a load average of 40 (about 60 s unloaded).

# Writes its environment to OUT/<job>-<pid>.json, then waits to be stopped.
WORKER = """
import json, os, pathlib, sys, time
keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", "TIDAL_JOB_ID")
out = pathlib.Path(sys.argv[1]) / f"{os.environ['TIDAL_JOB_ID']}-{os.getpid()}.json"
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps({k: os.environ.get(k) for k in keys}))
os.replace(tmp, out)  # never read half-written
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def log_tails_on_failure(cluster: tuple[CoordinatorProcess, AgentCluster]) -> Iterator[None]:
    """The coordinator's and agents' log tails, which pytest shows when the test fails
    (the with block above sees no exception from a test body)."""
    yield
    coordinator, agents = cluster
    print(coordinator.log_tail(), agents.log_tails(80), sep="\n")


def submit(api: httpx.Client, tmp_path: Path, name: str, gpus: int) -> str:
    out = tmp_path / "env"
    out.mkdir(exist_ok=True)
    spec = {"name": name, "command": [sys.executable, "-c", WORKER, str(out)],
            "gpus_per_node": gpus, "grace_period_s": 2, "max_restarts": 0}
    response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def worker_envs(tmp_path: Path, job_id: str) -> list[dict[str, Any]]:
    envs = []
    for path in sorted((tmp_path / "env").glob(f"{job_id}-*.json")):
        envs.append(json.loads(path.read_text()))
    return envs


def devices_of(api: httpx.Client, job_id: str) -> list[int]:
    view = job_view(api, job_id)
    if view["phase"] != "RUNNING" or len(view["nodes"]) != 1:
        return []
    return list(view["nodes"][0]["devices"])


def inventory(path: Path, *, failed: dict[int, str] | None = None) -> None:
    failed = failed or {}
    gpus = [{"index": i, "uuid": f"GPU-fake-{i}", "model": "Fake GPU", "numa_node": 0,
             "healthy": i not in failed, "fault": failed.get(i, "")} for i in range(4)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    os.replace(tmp, path)  # the agent never reads half a file


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_jobs_on_one_node_get_disjoint_devices(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster]
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent("g", extra=("--gpus", "0,1,2,3"))
    wait_for(lambda: [n["gpus"] for n in api.get("/v1/nodes").json()] == [4], timeout=60,
             what="node g to offer 4 GPUs")
    a = submit(api, tmp_path, "a", 2)
    b = submit(api, tmp_path, "b", 2)
    for job in (a, b):
        wait_for(lambda: len(worker_envs(tmp_path, job)) == 2,  # noqa: B023 (waited here)
                 timeout=300, what=f"both workers of {job} to start")
    # The third through the CLI (nproc_per_node follows gpus_per_node): no GPU is left.
    cli = subprocess.run(
        [sys.executable, "-m", "service.cli", "submit", "--url", coordinator.url, "--token", TOKEN,
         "--no-wait", "--name", "c", "--gpus-per-node", "1", "--",
         sys.executable, "-c", WORKER, str(tmp_path / "env")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert cli.returncode == 0, cli.stderr
    c = cli.stdout.strip()
    spec = job_view(api, c)["spec"]
    assert (spec["gpus_per_node"], spec["nproc_per_node"]) == (1, 1)

    seen: dict[str, set[int]] = {}
    for job in (a, b):
        envs = worker_envs(tmp_path, job)
        visible = {e["CUDA_VISIBLE_DEVICES"] for e in envs}
        assert len(visible) == 1, f"{job}'s workers saw different devices: {envs}"
        seen[job] = {int(i) for i in visible.pop().split(",")}
        assert len(seen[job]) == 2
        assert sorted(e["LOCAL_RANK"] for e in envs) == ["0", "1"]  # cuda:LOCAL_RANK is its own
        assert {e["CUDA_DEVICE_ORDER"] for e in envs} == {"PCI_BUS_ID"}
        want = sorted(seen[job])

        def shown(job: str = job, want: list[int] = want) -> bool:
            return devices_of(api, job) == want

        wait_for(shown, timeout=30, what=f"the API to show {job}'s devices")
    assert not seen[a] & seen[b], f"a device given to two jobs: {seen}"
    assert seen[a] | seen[b] == {0, 1, 2, 3}
    nodes = api.get("/v1/nodes").json()
    assert nodes[0]["gpus_used"] == 4 and sorted(nodes[0]["jobs"]) == sorted([a, b])
    assert job_view(api, c)["phase"] == "PENDING"

    # New bounds alone restart nothing (tests/e2e/test_patch_bounds.py): a's workers
    # go on, on the same devices, and no other job gets them.
    before = {p.name for p in (tmp_path / "env").iterdir()}
    assert api.patch(f"/v1/jobs/{a}", json={"max_nodes": 2}).status_code == 200

    def rewritten() -> bool:
        events = api.get(f"/v1/jobs/{a}/events").json()["events"]
        return any(e["message"].endswith("nothing restarts") for e in events)

    wait_for(rewritten, timeout=60, what=f"{a}'s assignment rewritten in place")
    assert devices_of(api, a) == sorted(seen[a])
    assert job_view(api, c)["phase"] == "PENDING"
    assert {p.name for p in (tmp_path / "env").iterdir()} == before  # no worker started


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failed_gpu_leaves_the_offer_and_its_job_loses_the_node(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster]
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    path = tmp_path / "gpus.json"
    # GPU 0 is out from the start (repaired later): the job's devices are then
    # not the lowest ones, which an agent without memory would pick.
    inventory(path, failed={0: "XID 48"})
    env = dict(os.environ, TIDAL_GPU_INVENTORY_FILE=str(path), TIDAL_GPU_POLL_S="0.2")
    agents.start_agent("h", env=env)
    wait_for(lambda: [n["slots"] for n in api.get("/v1/nodes").json()] == [3], timeout=60,
             what="node h to offer its 3 healthy GPUs")
    job = submit(api, tmp_path, "fragile", 2)
    wait_for(lambda: len(devices_of(api, job)) == 2 and len(worker_envs(tmp_path, job)) == 2,
             timeout=300, what="the job to run on 2 GPUs")
    first = devices_of(api, job)
    assert first == [1, 2]
    broken = first[1]
    before = {p.name for p in (tmp_path / "env").iterdir()}

    inventory(path, failed={0: "XID 48", broken: "XID 79: fell off the bus"})

    def gpu_out() -> bool:
        [node] = api.get("/v1/nodes").json()
        gpu = node["gpu_devices"][broken]
        return node["slots"] == 2 and not gpu["healthy"] and "XID 79" in gpu["fault"]

    wait_for(gpu_out, timeout=30, what=f"GPU {broken} to leave node h's offer")
    wait_for(lambda: "node_lost" in [e["reason"] for e in
                                     api.get(f"/v1/jobs/{job}/events").json()["events"]],
             timeout=60, what="the job to lose the node")

    def back_on_healthy() -> bool:
        started = [p for p in (tmp_path / "env").glob(f"{job}-*.json") if p.name not in before]
        return len(devices_of(api, job)) == 2 and len(started) == 2

    wait_for(back_on_healthy, timeout=180, what="the job to run again")
    again = devices_of(api, job)
    assert again == [1, 3], f"the job got the failed GPU {broken} back, or moved: {again}"
    fresh = [json.loads(p.read_text()) for p in (tmp_path / "env").iterdir()
             if p.name not in before and p.name.startswith(job)]
    assert all(str(broken) not in e["CUDA_VISIBLE_DEVICES"].split(",") for e in fresh), fresh

    cli = subprocess.run(
        [sys.executable, "-m", "service.cli", "nodes", "--url", coordinator.url,
         "--token", TOKEN], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert cli.returncode == 0, cli.stderr
    assert f"GPU {broken} GPU-fake-{broken} is out of service: XID 79" in cli.stdout, cli.stdout
    assert "(2 failed)" in cli.stdout

    # GPU 0 repaired: the offer grows back to 3 (the job keeps its devices).
    inventory(path, failed={broken: "XID 79: fell off the bus"})
    wait_for(lambda: [n["slots"] for n in api.get("/v1/nodes").json()] == [3], timeout=30,
             what="GPU 0 back in node h's offer")

    # The agent dies (SIGKILL, its runner and workers with it) and starts again:
    # the job comes back on the devices it had, 1 and 3 (remembered in the run
    # directory), not on the lowest free ones, 0 and 1.
    held = devices_of(api, job)
    assert held == [1, 3]
    before = {p.name for p in (tmp_path / "env").iterdir()}
    agents.kill_agent("h")
    wait_for(lambda: not api.get("/v1/nodes").json(), timeout=60, what="node h's lease to expire")
    agents.start_agent("h", env=env)

    def back_after_restart() -> bool:
        started = [p for p in (tmp_path / "env").glob(f"{job}-*.json") if p.name not in before]
        return len(started) == 2 and devices_of(api, job) == held

    wait_for(back_after_restart, timeout=300, what=f"the job back on GPUs {held}")
    fresh = [json.loads(p.read_text()) for p in (tmp_path / "env").glob(f"{job}-*.json")
             if p.name not in before]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in fresh} == {",".join(map(str, held))}
