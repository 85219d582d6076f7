"""Warm runners through real agents: taken by a job, refilled, discarded, never orphaned."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import (
    ELASTIC_DDP,
    AgentCluster,
    assign,
    is_idle_warm_runner,
    parent_of,
    processes_of_node,
    statuses,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

# A script that imports a module only the job's PYTHONPATH can reach.
USES_PYTHONPATH = """
import sys
import tidal_warm_helper
open(sys.argv[1], "w").write(tidal_warm_helper.WORD)
"""


def _cluster(tmp_path: Path, etcd_server: EtcdServer, etcd_root: str,
             procs: ProcessGroupRegistry) -> AgentCluster:
    return AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )


def _idle_warm_runner(node_id: str) -> int | None:
    """The pid of ``node_id``'s warm runner that waits for a job, if there is one."""
    for pid in processes_of_node(node_id, warm=True):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if is_idle_warm_runner(argv):
            return pid
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _zygotes(pid: int) -> list[int]:
    """``pid``'s children that are zygotes (not, say, the ``ldconfig`` that finding
    the C library runs for a moment)."""
    found = []
    for child in _children(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.workers.zygote" in argv:
            found.append(child)
    return found


def _job(tmp_path: Path, job_id: str, script: str, **fields: object) -> Assignment:
    path = tmp_path / f"{job_id}.py"
    path.write_text(script)
    return Assignment(
        job_id=job_id,
        command=[sys.executable, str(path), str(tmp_path / f"{job_id}.out")],
        min_nodes=1, max_nodes=1, max_restarts=0, **fields,  # type: ignore[arg-type]
    )


def _finished(client: EtcdClient, job_id: str, node_id: str) -> JobNodeState | None:
    status = statuses(client, job_id).get(node_id)
    done = (JobNodeState.SUCCEEDED, JobNodeState.FAILED)
    return status.state if status is not None and status.state in done else None


def test_the_warm_runner_takes_the_job_then_a_new_one_waits_for_the_next(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    cluster = _cluster(tmp_path, etcd_server, etcd_root, procs)
    cluster.start_agent("a")
    try:
        warm = wait_for(lambda: _idle_warm_runner("a"), timeout=30, what="a warm runner")
        # Its zygote is up beside it before any job exists.
        wait_for(lambda: _zygotes(warm), timeout=30, what="the warm runner's zygote")

        job = _job(tmp_path, "first", "import sys\nopen(sys.argv[1], 'w').write('done')\n")
        assign(etcd_client, "a", job)
        wait_for(lambda: _finished(etcd_client, "first", "a"), timeout=60, what="the job done")
        status = statuses(etcd_client, "first")["a"]
        assert status.state == JobNodeState.SUCCEEDED, status
        assert status.pid == warm, "the job ran in a runner started for it, not the warm one"
        assert (tmp_path / "first.out").read_text() == "done"
        runner_log = (cluster.workdir / "a" / "jobs" / "first" / "gen-1" / "runner.log").read_text()
        assert f"warm runner {warm} takes job first" in runner_log

        # The slot is free again: a new warm runner waits for the next job.
        again = wait_for(lambda: _idle_warm_runner("a"), timeout=60, what="the next warm runner")
        assert again != warm
    except Exception:
        print(cluster.log_tails())
        raise


@pytest.mark.slow  # 57 s under load
def test_a_new_generation_of_a_running_job_starts_in_a_warm_runner(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    """New bounds (a PATCH) give the job a new generation: the node's runner
    stops, and the next one was started while it stopped, though the only
    slot was in use until then (by a job with no restarts to spend, so no
    warm runner waited beside it as a spare)."""
    cluster = _cluster(tmp_path, etcd_server, etcd_root, procs)
    cluster.start_agent("a")
    job = Assignment(
        job_id="gens",
        command=[sys.executable, str(ELASTIC_DDP), "--checkpoint", str(tmp_path / "ckpt.pt"),
                 "--step-seconds", "0.1"],
        min_nodes=1, max_nodes=1, grace_period_s=5, max_restarts=0,
    )

    def running(generation: int) -> bool:
        status = statuses(etcd_client, "gens").get("a")
        return bool(status and status.generation == generation
                    and status.state == JobNodeState.RUNNING)

    try:
        assign(etcd_client, "a", job)
        wait_for(lambda: running(1), timeout=60, what="generation 1 running")
        assert _idle_warm_runner("a") is None, "a warm runner beside a job on the only slot"
        assign(etcd_client, "a", job.model_copy(update={"generation": 2, "max_nodes": 2}))
        wait_for(lambda: running(2), timeout=60, what="generation 2 running")
        log = (cluster.workdir / "a" / "jobs" / "gens" / "gen-2" / "runner.log").read_text()
        assert "takes job gens (generation 2)" in log, log[-2000:]
    except Exception:
        print(cluster.log_tails())
        raise


@pytest.mark.slow  # 47 s under load
def test_a_job_that_sets_pythonpath_gets_a_zygote_started_with_it(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    """The warm zygote imported torch with the agent's sys.path; a worker forked
    from it would not find the job's modules."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "tidal_warm_helper.py").write_text("WORD = 'found'\n")
    cluster = _cluster(tmp_path, etcd_server, etcd_root, procs)
    cluster.start_agent("a")
    try:
        warm = wait_for(lambda: _idle_warm_runner("a"), timeout=30, what="a warm runner")
        job = _job(tmp_path, "pypath", USES_PYTHONPATH, env={"PYTHONPATH": str(lib)})
        assign(etcd_client, "a", job)
        wait_for(lambda: _finished(etcd_client, "pypath", "a"), timeout=90, what="the job done")
        status = statuses(etcd_client, "pypath")["a"]
        assert status.state == JobNodeState.SUCCEEDED, status.error
        assert status.pid == warm
        assert (tmp_path / "pypath.out").read_text() == "found"
        runner_log = (cluster.workdir / "a" / "jobs" / "pypath" / "gen-1" / "runner.log")
        assert "the job sets PYTHONPATH: starting a zygote" in runner_log.read_text()
    except Exception:
        print(cluster.log_tails())
        raise


def test_a_killed_agent_takes_its_warm_runner_and_zygote_along(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry,
):
    """SIGKILL of the agent's process alone (not its group, as the OOM killer
    would): the parent-death signals take the warm runner, then its zygote."""
    cluster = _cluster(tmp_path, etcd_server, etcd_root, procs)
    agent = cluster.start_agent("a")
    warm = wait_for(lambda: _idle_warm_runner("a"), timeout=30, what="a warm runner")
    zygote = wait_for(lambda: _zygotes(warm), timeout=30, what="its zygote")[0]
    os.kill(agent.pid, signal.SIGKILL)
    wait_for(lambda: _gone(warm) and _gone(zygote), timeout=10,
             what="the warm runner and its zygote gone")
    # A process the zygote or the runner was forking as the signal came exits at its
    # own parent-death check, a moment later; one that lives on is an orphan.
    def none_left() -> bool:
        left = [_describe(pid) for pid in processes_of_node("a", warm=True)]
        if left:
            raise AssertionError(f"still running: {left}")  # wait_for shows the last one
        return True

    wait_for(none_left, timeout=10, what="no process of node a left")


def test_a_stopped_agent_discards_its_warm_runner_and_its_log(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry,
):
    cluster = _cluster(tmp_path, etcd_server, etcd_root, procs)
    agent = cluster.start_agent("a")
    wait_for(lambda: _idle_warm_runner("a"), timeout=30, what="a warm runner")
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(timeout=30) == 0
    assert not processes_of_node("a", warm=True)
    assert not list((cluster.workdir / "a" / "warm").iterdir())


@pytest.mark.slow  # 32 s under load
def test_without_warm_runners_the_agent_keeps_none(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
):
    cluster = _cluster(tmp_path, etcd_server, etcd_root, procs)
    cluster.start_agent("a", extra=("--no-warm-runner",))
    job = _job(tmp_path, "cold", "import sys\nopen(sys.argv[1], 'w').write('cold')\n")
    assign(etcd_client, "a", job)
    wait_for(lambda: _finished(etcd_client, "cold", "a"), timeout=60, what="the job done")
    assert statuses(etcd_client, "cold")["a"].state == JobNodeState.SUCCEEDED
    assert _idle_warm_runner("a") is None
    assert not (cluster.workdir / "a" / "warm").exists()


def _describe(pid: int) -> str:
    """``pid``, its parent and its command line, for an error message."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        argv = "?"
    return f"{pid} (parent {parent_of(pid)}): {argv.strip()}"


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
