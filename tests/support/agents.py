"""Run real `tidal agent` processes against a real etcd, and read what they report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rendezvous.etcd import Delete, EtcdClient, Put
from rendezvous.records import Assignment, JobNodeState, JobNodeStatus
from tests.support.processes import ProcessGroupRegistry

ELASTIC_DDP = Path(__file__).resolve().parents[2] / "examples" / "elastic_ddp.py"


def is_idle_warm_runner(argv: list[bytes]) -> bool:
    """Whether a command line (``/proc/PID/cmdline`` split on NUL) is a warm runner
    still waiting for a job. One that took a job retitles itself as a cold runner."""
    return b"agent.runner" in argv and b"--warm" in argv


def parent_of(pid: int) -> int | None:
    """``pid``'s parent, or None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


#: Set by tests/conftest.py to the pytest process's PID: every process a test session
#: starts inherits it, so processes_of_node sees only this session's node "a", not
#: that of another session running beside it on the same machine.
SESSION_VAR = "PYTEST_TIDAL_SESSION"


def processes_of_node(node_id: str, *, warm: bool = False) -> list[int]:
    """PIDs of live processes whose environment says they work for ``node_id``.

    The runner exports TIDAL_NODE_ID to every worker, so this finds a node's
    workers even after they were re-parented; only this test session's
    processes count (:data:`SESSION_VAR`). A warm runner that waits for a
    job and its zygote work for no job: they are left out unless ``warm``.
    """
    needle = f"TIDAL_NODE_ID={node_id}".encode()
    mine = os.environ.get(SESSION_VAR)
    session = None if mine is None else f"{SESSION_VAR}={mine}".encode()
    found: dict[int, int] = {}  # pid -> parent pid
    idle: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        variables = environ.split(b"\0")
        if stat[0] != "Z" and needle in variables and (session is None or session in variables):
            found[int(entry.name)] = int(stat[1])
            if is_idle_warm_runner(argv):
                idle.add(int(entry.name))
    if warm:
        return sorted(found)
    return sorted(pid for pid, parent in found.items() if pid not in idle and parent not in idle)


class AgentCluster:
    """Agents as separate processes, each in its own process group."""

    def __init__(
        self, *, etcd_endpoint: str, etcd_root: str, workdir: Path, procs: ProcessGroupRegistry
    ) -> None:
        self.etcd_endpoint = etcd_endpoint
        self.etcd_root = etcd_root
        self.workdir = workdir
        self.procs = procs
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def start_agent(
        self,
        node_id: str,
        *,
        lease_ttl_s: int = 3,
        metrics_port: int | None = None,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``tidal agent`` for ``node_id``; ``extra`` flags are appended and
        ``env`` (default: this process's) is its environment."""
        argv = [
            sys.executable, "-m", "service.cli", "agent",
            "--etcd", self.etcd_endpoint,
            "--etcd-root", self.etcd_root,
            "--node-id", node_id,
            "--run-dir", str(self.workdir / node_id),
            "--lease-ttl", str(lease_ttl_s),
        ]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        argv += extra
        proc = self.procs.spawn(argv, log_path=self.workdir / f"agent-{node_id}.log", env=env)
        self.agents[node_id] = proc
        return proc

    def kill_agent(self, node_id: str) -> None:
        """SIGKILL the agent's process group, as a dying machine would."""
        self.procs.kill_group(self.agents[node_id])

    def log_tails(self, lines: int = 40) -> str:
        out = []
        for node_id in self.agents:
            own = self.workdir / f"agent-{node_id}.log"
            paths = [*sorted((self.workdir / node_id).rglob("*.log")), own]
            for path in paths:
                if path.exists():
                    text = path.read_text(errors="replace").splitlines()[-lines:]
                    out.append(f"--- {path} ---\n" + "\n".join(text))
        return "\n".join(out)


def warm_runner_ready(run_dir: Path) -> bool:
    """Whether the agent whose ``--run-dir`` is ``run_dir`` has a warm runner that
    imported torch and whose zygote is up: a job given to it starts without those."""
    logs = [p.read_text(errors="replace") for p in (run_dir / "warm").glob("*.log")]
    return any("zygote ready" in t and "ready for a job" in t for t in logs)


def job_record_for(assignment: Assignment, nodes: dict[str, int]) -> bytes:
    """The coordinator's record of ``assignment``'s job, placed on ``nodes``
    (node -> generation): what an agent checks an assignment against
    (agent.admission). The spec is built unvalidated, so that a test may give
    its job ``TIDAL_*`` variables that a user could not."""
    from service.api.models import JobRecord, JobSpec

    spec = JobSpec.model_construct(
        name="test", command=list(assignment.command), env=dict(assignment.env),
        min_nodes=assignment.min_nodes, max_nodes=assignment.max_nodes,
        nproc_per_node=assignment.nproc_per_node, max_restarts=assignment.max_restarts,
        grace_period_s=assignment.grace_period_s, working_dir=None, checkpoint_dir=None,
        node_selector={}, priority=0, resize_policy=None,
        zygote_preload=list(assignment.zygote_preload),
    )
    record = JobRecord(
        job_id=assignment.job_id, spec=spec, cwd=assignment.cwd,
        checkpoint_path=assignment.checkpoint_dir, nodes=nodes,
    )
    return record.model_dump_json().encode()


def assign(client: EtcdClient, node_id: str, assignment: Assignment) -> None:
    """Assign a job to a node as the coordinator does: its record (with this
    node at this generation) and the assignment, in one transaction."""
    job_key = client.keys.job(assignment.job_id)
    old = client.get(job_key)
    nodes = json.loads(old.value).get("nodes", {}) if old is not None else {}
    nodes[node_id] = assignment.generation
    client.txn([], [
        Put(job_key, job_record_for(assignment, nodes)),
        Put(client.keys.assignment(node_id, assignment.job_id),
            assignment.model_dump_json().encode()),
    ])


def assign_by_hand(client: EtcdClient, node_id: str, assignment: Assignment) -> None:
    """Put an assignment as anyone who can write to etcd could: no job record."""
    client.put(client.keys.assignment(node_id, assignment.job_id),
               assignment.model_dump_json().encode())


def unassign(client: EtcdClient, node_id: str, job_id: str) -> None:
    """Take a job off a node as the coordinator does: the assignment, and the
    node from the job's record (a round waits for the nodes the record names)."""
    job_key = client.keys.job(job_id)
    old = client.get(job_key)
    ops: list[Put | Delete] = [Delete(client.keys.assignment(node_id, job_id))]
    if old is not None:
        record = json.loads(old.value)
        record.get("nodes", {}).pop(node_id, None)
        ops.append(Put(job_key, json.dumps(record).encode()))
    client.txn([], ops)


def statuses(client: EtcdClient, job_id: str) -> dict[str, JobNodeStatus]:
    kvs, _ = client.get_prefix(client.keys.job_status_prefix(job_id))
    out = {}
    for kv in kvs:
        status = JobNodeStatus.model_validate_json(kv.value)
        out[status.node_id] = status
    return out


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def nodes_in_state(client: EtcdClient, job_id: str, nodes: set[str], *, size: int | None = None,
                   state: JobNodeState = JobNodeState.RUNNING, min_step: int = 0) -> bool:
    """Whether every one of ``nodes`` reports ``job_id`` in ``state`` (at world size
    ``size``, past ``min_step``)."""
    st = statuses(client, job_id)
    return nodes <= set(st) and all(
        st[n].state == state
        and (size is None or st[n].world_size == size)
        and (st[n].last_step or 0) >= min_step
        for n in nodes
    )
