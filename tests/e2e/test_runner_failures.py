"""A runner that cannot start or dies: the job recovers or FAILS with the cause, in seconds.

Real etcd, a real coordinator, real agents and the real CLI:

* ``tidal submit --workdir exprs/run1`` where the directory is missing: the job
  ends FAILED with "working directory ... does not exist" and the CLI exits 1;
* a working directory that is a file: FAILED, "is not a directory";
* a symlink out of the root made after submit: FAILED, nothing ran there;
* ``kill -9`` of the runner: it is restarted (charged to the budget) in the
  warm runner kept beside the job, and training goes on; once the budget is
  spent, the job FAILS naming SIGKILL;
* a runner that raises: restarted on the budget, then FAILED with its traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import (
    AgentCluster,
    assign,
    is_idle_warm_runner,
    processes_of_node,
    statuses,
)
from tests.support.coordinator import TOKEN, CoordinatorProcess, job_view
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
# A node id no other test uses: processes are found by TIDAL_NODE_ID, and
# other tests may run on this machine at the same time.
NODE = "runner-failures"

# From assignment (or a runner's death) to FAILED: the agent's next pass
# (0.5 s; it checks the directories before any runner starts), then the
# coordinator's. Measured 0.3-0.6 s under load; generous for a loaded 2-core
# machine, and far below "for ever".
FAIL_FAST_S = 20.0




def _failed(api: httpx.Client, job_id: str) -> dict[str, Any] | None:
    view = job_view(api, job_id)
    return view if view["phase"] == "FAILED" else None


def _submit(api: httpx.Client, **spec: Any) -> str:
    body = {"name": "j", "min_nodes": 1, "max_nodes": 1, **spec}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _wait_ready(api: httpx.Client, node: str) -> None:
    wait_for(lambda: node in {n["node_id"] for n in api.get("/v1/nodes").json()},
             timeout=60, what=f"node {node} registered")


@pytest.mark.timeout(180)
def test_a_missing_working_directory_fails_the_job_and_submit_exits_1(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], procs: ProcessGroupRegistry
):
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent(NODE)
    _wait_ready(api, NODE)
    out = tmp_path / "submit.out"
    started = time.monotonic()
    cli = procs.spawn(
        [sys.executable, "-m", "service.cli", "submit", "--url", coordinator.url,
         "--token", TOKEN, "--workdir", "exprs/run1", "--", "python", "-c", "print(1)"],
        log_path=out,
    )
    code = wait_for(lambda: cli.poll() is not None and (cli.returncode,), timeout=60,
                    what="tidal submit returning")[0]
    took = time.monotonic() - started
    text = out.read_text()
    assert code == 1, text
    expected = f"working directory {coordinator.workdir_root}/exprs/run1 does not exist"
    assert expected in text
    assert took < FAIL_FAST_S + 10, took
    job_id = api.get("/v1/jobs").json()["jobs"][0]["job_id"]
    view = job_view(api, job_id)
    assert view["phase"] == "FAILED"
    assert view["world_size"] == 0
    assert expected in view["error"]["message"]
    # The node's slot is free again: nothing of the job runs there.
    wait_for(lambda: not processes_of_node(NODE), timeout=15, what="nothing left on the node")


@pytest.mark.timeout(180)
def test_a_working_directory_that_is_a_file_fails_the_job(
    cluster: tuple[CoordinatorProcess, AgentCluster]
):
    coordinator, agents = cluster
    api = coordinator.client()
    (coordinator.workdir_root / "notes").write_text("not a directory")
    agents.start_agent(NODE)
    job_id = _submit(api, command=["python", "-c", "print(1)"], working_dir="notes")
    view = wait_for(lambda: _failed(api, job_id), timeout=60, what="the job FAILED")
    assert view["error"]["message"] == (
        f"working directory {coordinator.workdir_root}/notes is not a directory")


@pytest.mark.timeout(180)
def test_a_symlink_out_of_the_root_made_after_submit_is_refused_and_nothing_runs_there(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster]
):
    coordinator, agents = cluster
    api = coordinator.client()
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = "tidal-was-here"
    # No agent yet: the job waits (PENDING) while the link is made under it.
    job_id = _submit(
        api, working_dir="exp", checkpoint_dir="exp",
        command=["python", "-c", f"open({marker!r}, 'w').write('x')"],
    )
    assert job_view(api, job_id)["phase"] == "PENDING"
    (coordinator.workdir_root / "exp").symlink_to(outside)
    agents.start_agent(NODE)
    view = wait_for(lambda: _failed(api, job_id), timeout=60, what="the job FAILED")
    message = view["error"]["message"]
    assert f"working directory {coordinator.workdir_root}/exp is a symbolic link" in message
    assert str(outside) in message
    assert not (outside / marker).exists()
    assert list(outside.iterdir()) == []


def _progress(run_dir: Path, job_id: str) -> dict[str, Any] | None:
    """Rank 0's progress report of ``job_id``'s first generation on the node, if any."""
    path = run_dir / "jobs" / job_id / "gen-1" / "progress" / "rank-0.json"
    try:
        report: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report


def _first_step_after(run_dir: Path, job_id: str, killed_at: float, old_worker: int) -> float:
    """Seconds from ``killed_at`` (Unix time) to the first step of a new worker."""
    report = wait_for(
        lambda: (r := _progress(run_dir, job_id)) is not None and r["pid"] != old_worker
        and r["first_step_time"] is not None and r,
        timeout=120, what="a new worker's first step",
    )
    return float(report["first_step_time"]) - killed_at


def _ready_warm_runner(run_dir: Path, node: str) -> int | None:
    """The pid of the node's warm runner once it waits for a job, torch imported."""
    for pid in processes_of_node(node, warm=True):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if is_idle_warm_runner(argv):
            ready = f"warm runner {pid} ready for a job"
            logs = (run_dir / "warm").glob("runner-*.log")
            return pid if any(ready in p.read_text(errors="replace") for p in logs) else None
    return None


def _runner_pid(client: EtcdClient, job_id: str, node: str, *, not_pid: int = 0) -> int | None:
    status = statuses(client, job_id).get(node)
    if status is None or status.state.value != "running" or status.pid in (0, not_pid):
        return None
    return status.pid


@pytest.mark.slow  # 54 s under load: a runner restarted on its budget
@pytest.mark.timeout(300)
def test_a_sigkilled_runner_is_restarted_on_the_budget_then_the_job_fails_with_the_cause(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient
):
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent(NODE)
    job_id = _submit(  # checkpoints in $TIDAL_CHECKPOINT_DIR (checkpoint_dir "mlp")
        api, max_restarts=1, checkpoint_dir="mlp",
        command=["python", str(MLP), "--total-steps", "100000", "--every-steps", "5",
                 "--step-seconds", "0.1"],
    )

    def step() -> int:
        return int(job_view(api, job_id)["last_step"] or 0)

    wait_for(lambda: step() >= 3, timeout=120, what="3 steps")
    first = wait_for(lambda: _runner_pid(etcd_client, job_id, NODE), timeout=30,
                     what="the runner's pid in its status")
    # The node's only slot is in use, yet a warm runner waits beside the job:
    # the spare that replaces its runner if it dies.
    spare = wait_for(lambda: _ready_warm_runner(tmp_path / NODE, NODE), timeout=90,
                     what="a warm runner ready beside the job")
    worker = wait_for(lambda: _progress(tmp_path / NODE, job_id), timeout=30,
                      what="a progress report")["pid"]
    os.kill(first, signal.SIGKILL)
    killed = time.monotonic()
    killed_at = time.time()
    # Restarted, charged: one worker_failed restart, the budget down to 0.
    status = wait_for(
        lambda: (s := statuses(etcd_client, job_id).get(NODE)) is not None
        and s.restart_reasons.get("worker_failed") == 1 and s,
        timeout=10, what="the runner's death charged",
    )
    noticed = time.monotonic() - killed
    assert status.error is not None and status.error.signal == "SIGKILL"
    assert f"the runner (pid {first}) was killed by SIGKILL" in status.error.message
    second = wait_for(lambda: _runner_pid(etcd_client, job_id, NODE, not_pid=first),
                      timeout=60, what="a new runner running")
    assert second == spare, "the runner was replaced by a cold one, not the warm spare"
    recovered = _first_step_after(tmp_path / NODE, job_id, killed_at, worker)
    before = step()
    wait_for(lambda: step() > before, timeout=60, what="training going on")
    view = job_view(api, job_id)
    assert view["phase"] == "RUNNING"
    assert view["restarts"].get("worker_failed") == 1
    assert statuses(etcd_client, job_id)[NODE].remaining_restarts == 0
    # Again: the budget is spent, so the job fails with the cause.
    os.kill(second, signal.SIGKILL)
    killed = time.monotonic()
    view = wait_for(lambda: _failed(api, job_id), timeout=FAIL_FAST_S, what="the job FAILED")
    failed_after = time.monotonic() - killed
    assert f"the runner (pid {second}) was killed by SIGKILL" in view["error"]["message"]
    wait_for(lambda: not processes_of_node(NODE), timeout=15, what="no worker left on the node")
    print(f"runner death charged after {noticed:.2f} s; first new step {recovered:.2f} s "
          f"after the kill; job FAILED {failed_after:.2f} s after the second kill")


@pytest.mark.slow  # 42 s under load: a runner restarted on its budget
@pytest.mark.timeout(180)
def test_a_runner_that_raises_is_restarted_on_the_budget_then_fails_with_its_traceback(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    agents = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    # The job's log directory is a file: the runner raises once it has written
    # its first status, every time (as the daemon sees it, a bug of the runner).
    job = Assignment(job_id="crashy", command=["python", "-c", "print(1)"], min_nodes=1,
                     max_nodes=1, max_restarts=1)
    job_dir = tmp_path / NODE / "jobs" / "crashy" / "gen-1"
    job_dir.mkdir(parents=True)
    (job_dir / "logs").write_text("not a directory")
    agents.start_agent(NODE)
    try:
        assign(etcd_client, NODE, job)
        status = wait_for(
            lambda: (s := statuses(etcd_client, "crashy").get(NODE)) is not None
            and s.state == JobNodeState.FAILED and s,
            timeout=120, what="the job FAILED on the node",
        )
    except BaseException:
        print(agents.log_tails())
        raise
    assert status.restart_reasons == {"worker_failed": 2}  # the restart, then the end
    assert status.remaining_restarts == 0
    assert status.error is not None
    assert status.error.exit_code == 4
    assert status.error.message.startswith("the runner (pid ")
    assert status.error.message.endswith(
        f"exited with code 4: NotADirectoryError: log_dir: {job_dir}/logs is a file")
    assert "Traceback" in status.error.traceback
    wait_for(lambda: not processes_of_node(NODE), timeout=15, what="nothing left on the node")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigkilled_runner_of_a_two_node_job_rejoins_and_the_job_trains_on_at_two(
    cluster: tuple[CoordinatorProcess, AgentCluster], etcd_client: EtcdClient
):
    coordinator, agents = cluster
    api = coordinator.client()
    other = f"{NODE}-2"
    agents.start_agent(NODE)
    agents.start_agent(other)
    job_id = _submit(
        api, max_restarts=2, min_nodes=1, max_nodes=2, checkpoint_dir="mlp",
        command=["python", str(MLP), "--total-steps", "100000", "--every-steps", "5",
                 "--step-seconds", "0.1", "--global-batch-size", "8"],
    )

    def at_two() -> bool:
        view = job_view(api, job_id)
        return view["phase"] == "RUNNING" and view["world_size"] == 2

    wait_for(at_two, timeout=120, what="RUNNING at world size 2")
    wait_for(lambda: int(job_view(api, job_id)["last_step"] or 0) >= 3, timeout=60, what="3 steps")
    victim = wait_for(lambda: _runner_pid(etcd_client, job_id, NODE), timeout=30,
                      what="the runner's pid")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: _runner_pid(etcd_client, job_id, NODE, not_pid=victim), timeout=60,
             what="a new runner running")
    before = int(job_view(api, job_id)["last_step"] or 0)
    wait_for(lambda: at_two() and int(job_view(api, job_id)["last_step"] or 0) > before,
             timeout=90, what="training on at world size 2")
    status = statuses(etcd_client, job_id)[NODE]
    assert status.restart_reasons.get("worker_failed") == 1
    assert job_view(api, job_id)["phase"] == "RUNNING"
