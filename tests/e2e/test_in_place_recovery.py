"""The acid test through unplanned failures recovered in place: the survivors keep their processes.

Three `tidal agent` processes run examples/mlp.py --live-resize (float64, the
checkpoints library, DDP over gloo, a periodic checkpoint only every 1000
steps: never within the run). Then:

1. node c's workers stop before step :data:`HANG_AT` (``--hang-before-step``,
   fault injection), so that a and b wait in that step's gradient all-reduce;
   once c says it hangs, c's agent is SIGKILLed with its process group (a
   dying machine) while the others are inside the all-reduce;
2. once a and b train at world size 2, a's agent (rank 0's node) is SIGKILLed
   the same way, mid-training.

A second test stops every process of node c instead (SIGSTOP: a host that
hangs, no FIN): the survivors learn of it from the lease (3 s), their
watchdog shuts the old group's sockets down, and they recover in place the same way.

Each time the survivors' collective fails, their runners tell them the next
round, and they re-form the group in place: every survivor's worker keeps
its PID across both kills (each node started one worker, ever), no worker
saved just in time or restored a checkpoint, every step was taken (0 lost),
the runners say the path was "live" for a lost member, and the final
parameters equal those of the same job run uninterrupted under plain
torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.acid import (
    MLP,
    assert_same_params,
    max_difference,
    record_params,
    start_reference,
    wait_reference,
)
from tests.support.agents import (
    AgentCluster,
    assign,
    nodes_in_state,
    processes_of_node,
    statuses,
    unassign,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
TOTAL, HANG_AT = 70, 12
ARGS = [
    "--total-steps", str(TOTAL), "--global-batch-size", "10", "--dataset-size", "96",
    "--dtype", "float64", "--every-steps", "1000", "--seed", "5",
]
# mlp.py logs "<asctime> [pid P] rank R world_size W step S loss L" after step S.
_STEP = re.compile(r"\[pid (\d+)\] rank (\d+) world_size (\d+) step (\d+) loss")


def _worker_lines(root: Path, node: str) -> list[str]:
    lines: list[str] = []
    for path in sorted((root / node).glob("jobs/*/gen-*/logs/**/stderr.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


def _steps(root: Path, node: str) -> list[tuple[int, int, int, int]]:
    """(pid, rank, world size, step) of every step line of ``node``'s workers."""
    return [tuple(int(g) for g in m.groups())  # type: ignore[misc]
            for line in _worker_lines(root, node) if (m := _STEP.search(line))]


def _mlp_job(tmp_path: Path, args: list[str], *extra: str) -> tuple[Assignment, Path]:
    """The job every test here runs on a, b and c (in place, a step every 0.1 s), and the
    file its parameters are recorded in at the end."""
    record = tmp_path / "elastic.json"
    job = Assignment(
        job_id="mlp",
        command=[sys.executable, str(MLP), "--checkpoint-dir", str(tmp_path / "ckpt"), *args,
                 "--step-seconds", "0.1", "--record", str(record), "--live-resize", *extra],
        env={"OMP_NUM_THREADS": "1"},
        min_nodes=1, max_nodes=3, max_restarts=0, grace_period_s=10,
    )
    return job, record


def _start(tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
           procs: ProcessGroupRegistry, job: Assignment) -> AgentCluster:
    """Agents a, b and c, each assigned ``job``."""
    cluster = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    )
    for node in ("a", "b", "c"):
        cluster.start_agent(node)
        assign(etcd_client, node, job)
    return cluster


def _succeeded(etcd_client: EtcdClient, nodes: set[str], ref: Any, tmp_path: Path) -> None:
    """Wait for the job to succeed on ``nodes`` and the reference run to end."""
    wait_for(lambda: nodes_in_state(etcd_client, "mlp", nodes, state=JobNodeState.SUCCEEDED),
             timeout=180, what=f"the job succeeded on {sorted(nodes)}")
    wait_reference(ref, tmp_path, timeout=120)


def _paths(client: EtcdClient, node: str) -> dict[str, int]:
    st = statuses(client, "mlp").get(node)
    return dict(st.resize_paths) if st is not None else {}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_of_two_killed_nodes_keep_their_processes_and_end_with_the_reference(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    ref, reference_record = start_reference(procs, tmp_path, ARGS)
    hang_file = tmp_path / "c-hangs"
    job, record = _mlp_job(tmp_path, ARGS, "--hang-before-step", str(HANG_AT),
                           "--hang-node", "c", "--hang-file", str(hang_file))
    cluster = _start(tmp_path, etcd_server, etcd_root, etcd_client, procs, job)
    try:
        wait_for(hang_file.exists, timeout=240, what=f"node c hanging before step {HANG_AT}")
        wait_for(lambda: nodes_in_state(etcd_client, "mlp", {"a", "b", "c"}, size=3),
                 timeout=30, what="world size 3")
        # a and b are in step HANG_AT's all-reduce now, waiting for c.
        cluster.kill_agent("c")
        unassign(etcd_client, "c", "mlp")
        wait_for(lambda: not processes_of_node("c", warm=True), timeout=10,
                 what="node c's processes gone")
        wait_for(lambda: nodes_in_state(etcd_client, "mlp", {"a", "b"}, size=2,
                                        min_step=HANG_AT + 5),
                 timeout=60, what="a and b training at world size 2")
        cluster.kill_agent("a")  # rank 0's node, mid-training
        unassign(etcd_client, "a", "mlp")
        wait_for(lambda: not processes_of_node("a", warm=True), timeout=10,
                 what="node a's processes gone")
        _succeeded(etcd_client, {"b"}, ref, tmp_path)
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    a, b = _steps(tmp_path, "a"), _steps(tmp_path, "b")
    log.info("a's steps at world sizes %s; b's at %s",
             sorted({s[2] for s in a}), sorted({s[2] for s in b}))
    # Every survivor's worker kept its process: one PID per node, over both kills.
    assert len({s[0] for s in a}) == 1 and len({s[0] for s in b}) == 1, (
        {s[0] for s in a}, {s[0] for s in b})
    assert {s[2] for s in b} == {3, 2, 1}, sorted({s[2] for s in b})
    lines = _worker_lines(tmp_path, "a") + _worker_lines(tmp_path, "b")
    assert sum("start at step" in line for line in lines) == 2
    assert sum("recovered in place" in line for line in _worker_lines(tmp_path, "b")) == 2
    assert not any("just-in-time save of step" in line for line in lines)
    assert not any("restored step" in line for line in lines)
    # 0 steps lost: every step was completed by some survivor, in order.
    assert {s[3] for s in a + b} == set(range(TOTAL))
    # b's runner took the live path for both losses, the restart path never.
    assert _paths(etcd_client, "b") == {"live": 2}, _paths(etcd_client, "b")

    got, want = record_params(record), record_params(reference_record)
    log.info("max abs parameter difference vs the uninterrupted run: %.3g",
             max_difference(got, want))
    assert_same_params(got, want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_of_a_hung_node_keep_their_processes_and_end_with_the_reference(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    total = 40
    args = [*ARGS[:1], str(total), *ARGS[2:]]
    ref, reference_record = start_reference(procs, tmp_path, args)
    hang_file = tmp_path / "c-hangs"
    job, record = _mlp_job(tmp_path, args, "--hang-before-step", str(HANG_AT),
                           "--hang-node", "c", "--hang-file", str(hang_file))
    stopped: list[int] = []
    cluster = _start(tmp_path, etcd_server, etcd_root, etcd_client, procs, job)
    try:
        wait_for(hang_file.exists, timeout=240, what=f"node c hanging before step {HANG_AT}")
        stopped = [*processes_of_node("c", warm=True), cluster.agents["c"].pid]
        for pid in stopped:  # the host hangs: nothing of it answers, no socket closes
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        unassign(etcd_client, "c", "mlp")
        _succeeded(etcd_client, {"a", "b"}, ref, tmp_path)
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    a, b = _steps(tmp_path, "a"), _steps(tmp_path, "b")
    assert len({s[0] for s in a}) == 1 and len({s[0] for s in b}) == 1
    lines = _worker_lines(tmp_path, "a") + _worker_lines(tmp_path, "b")
    assert sum("recovered in place" in line for line in lines) == 2, "\n".join(
        line for line in lines if "collective" in line or "lost" in line)
    assert sum("shut down" in line for line in lines) >= 1  # the watchdog unblocked them
    assert not any("just-in-time save of step" in line for line in lines)
    assert {s[3] for s in a + b} == set(range(total))
    assert _paths(etcd_client, "a") == {"live": 1} == _paths(etcd_client, "b")
    assert_same_params(record_params(record), record_params(reference_record))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_drain_during_an_in_place_recovery_and_the_dead_node_coming_back(
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_root: str,
    etcd_client: EtcdClient,
    procs: ProcessGroupRegistry,
) -> None:
    """c's node dies and, in the same moment, b is drained (its assignment taken away):
    a recovers in place from the loss and b leaves, in whichever order their runners
    see them; a goes on alone. Then c's agent comes back and c joins the job live.
    a keeps its process throughout, every step is taken, and the job ends with the
    parameters of an uninterrupted run."""
    total = 600  # at 0.1 s a step: still training when c is back (its agent, warm runner
    # and zygote start again: 30 s and more on a loaded machine)
    args = [*ARGS[:1], str(total), *ARGS[2:]]
    ref, reference_record = start_reference(procs, tmp_path, args)
    job, record = _mlp_job(tmp_path, args)
    cluster = _start(tmp_path, etcd_server, etcd_root, etcd_client, procs, job)
    try:
        wait_for(lambda: nodes_in_state(etcd_client, "mlp", {"a", "b", "c"}, size=3,
                                        min_step=HANG_AT),
                 timeout=240, what="world size 3")
        cluster.kill_agent("c")
        unassign(etcd_client, "c", "mlp")
        unassign(etcd_client, "b", "mlp")  # the drain, while a and b recover from c's loss
        wait_for(lambda: not processes_of_node("c", warm=True), timeout=10,
                 what="node c's processes gone")
        wait_for(lambda: not processes_of_node("b"), timeout=60, what="b's workers gone")
        wait_for(lambda: nodes_in_state(etcd_client, "mlp", {"a"}, size=1, min_step=HANG_AT + 5),
                 timeout=60, what="a training alone")
        cluster.start_agent("c")  # c's machine is back, under the same name
        assign(etcd_client, "c", job.model_copy(update={"generation": 2}))
        _succeeded(etcd_client, {"a", "c"}, ref, tmp_path)
    except Exception:
        log.error("%s", cluster.log_tails())
        raise
    a, c = _steps(tmp_path, "a"), _steps(tmp_path, "c")
    log.info("a's steps at world sizes %s; a's resize paths %s",
             sorted({s[2] for s in a}), _paths(etcd_client, "a"))
    assert len({s[0] for s in a}) == 1, {s[0] for s in a}  # a kept its process throughout
    assert {1, 2} <= {s[2] for s in a}, sorted({s[2] for s in a})  # alone, then with c
    lines = _worker_lines(tmp_path, "a")
    assert not any("restored step" in line for line in lines)
    assert {s[3] for s in a} | {s[3] for s in c} | {s[3] for s in _steps(tmp_path, "b")} == (
        set(range(total)))
    assert _paths(etcd_client, "a").get("restart", 0) == 0, _paths(etcd_client, "a")
    assert_same_params(record_params(record), record_params(reference_record))
