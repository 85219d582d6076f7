"""What a job's runner is built from: its rendezvous handler, its worker spec, its first status.

:func:`agent.runner.elastic.run` puts them together with the
:class:`~agent.runner.elastic.TidalElasticAgent`; they are apart so that each is one
function of the runner's spec (:class:`agent.spec.RunnerSpec`) that a test
can call.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.agent.server.api import WorkerSpec

from agent.admission import record_nodes
from agent.spec import RunnerSpec, job_command
from rendezvous.elastic.assigned import AssignedRendezvousHandler
from rendezvous.elastic.assigned_rounds import Fence
from rendezvous.etcd import EtcdClient, Get
from rendezvous.keys import Keys
from rendezvous.records import JobNodeState, JobNodeStatus


def assigned_nodes(client: EtcdClient, keys: Keys, job_id: str) -> set[str]:
    """The registered nodes the coordinator assigned ``job_id`` to: whom a round waits for.

    They are read from the job's record (``jobs/<job>``, which only the
    coordinator writes; :func:`agent.admission.record_nodes`), not from the
    ``assignments/`` keys: an assignment written by anyone else on another
    node (one its agent never runs) would make every round wait
    ``assigned_wait`` for a node that never joins. The record names a node as
    soon as the coordinator places the job there, at the generation its
    assignment is to hold, even when a large job's assignments are written
    after it.
    """
    record = client.get(keys.job(job_id))
    assigned = sorted(record_nodes(job_id, None if record is None else record.value))
    # Only the round leader calls this, once per round; it reads the job's own
    # nodes' keys (in transactions of at most 64 reads), not the whole nodes/ prefix.
    registered: set[str] = set()
    for start in range(0, len(assigned), 64):
        chunk = assigned[start:start + 64]
        result = client.txn([], [Get(keys.node(n)) for n in chunk])
        registered |= {node for node, kvs in zip(chunk, result.gets, strict=True) if kvs}
    return registered


def initial_status(spec: RunnerSpec, pid: int) -> JobNodeStatus:
    """The first status record of a runner: a fresh one, or its dead predecessor's, going on."""
    job = spec.assignment
    if spec.prior is not None:
        return spec.prior.model_copy(update={
            "state": JobNodeState.STARTING, "world_size": 0, "ranks": [], "pid": pid,
            "devices": spec.devices or [],
        })
    return JobNodeStatus(
        job_id=job.job_id,
        node_id=spec.node_id,
        generation=job.generation,
        state=JobNodeState.STARTING,
        remaining_restarts=job.max_restarts,
        devices=spec.devices or [],
        pid=pid,
    )


def make_handler(spec: RunnerSpec, client: EtcdClient, keys: Keys) -> AssignedRendezvousHandler:
    """The job's rendezvous on this node, fenced by its assignment (rendezvous.elastic.assigned)."""
    job = spec.assignment
    conf = job.rdzv_conf
    return AssignedRendezvousHandler(
        client,
        run_id=job.job_id,
        node_id=spec.node_id,
        addr=spec.address,
        min_nodes=job.min_nodes,
        max_nodes=job.max_nodes,
        root=spec.etcd.root,
        expected_nodes=lambda: assigned_nodes(client, keys, job.job_id),
        assigned_wait_s=float(conf.get("assigned_wait", 30)),
        lease_ttl_s=spec.lease_ttl_s,
        join_timeout_s=float(conf.get("join_timeout", 600)),
        fence=Fence(keys.assignment(spec.node_id, job.job_id), job.generation),
    )


def make_worker_spec(spec: RunnerSpec, handler: AssignedRendezvousHandler, *,
                     remaining_restarts: int) -> WorkerSpec:
    """torch elastic's description of the worker group: every worker through the shim.

    ``remaining_restarts``: what is left of the budget, less than the job's after
    this generation's runner died here (agent.node.supervise).
    """
    job = spec.assignment
    return WorkerSpec(
        role="trainer",
        local_world_size=job.nproc_per_node,
        entrypoint=sys.executable,
        args=("-m", "agent.workers.shim", str(os.getpid()), "--",
              *job_command(job.command, sys.executable)),
        rdzv_handler=handler,
        max_restarts=remaining_restarts,
        monitor_interval=0.1,
        local_addr=spec.address,
    )
