"""How the API shows a job and a node: the job's record joined with its nodes' reports,
a node's slots and GPUs in use (pure functions of what was read from etcd)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rendezvous.records import JobNodeState, JobNodeStatus
from service.api.models import JobRecord, JobView, NodeInJob, NodeView, SpecView
from service.coordinator.store import Snapshot
from service.scheduler.reports import CHARGED_REASON, restart_charges, statuses_in_force


def progress_fields(current: dict[str, JobNodeStatus], statuses: dict[str, JobNodeStatus]
                    ) -> dict[str, Any]:
    """JobView's progress from the nodes' reports: the largest rate (each is the job's
    global rate as one rank measures it), the mean loss and the total over the nodes
    in force, the newest checkpoint's time over every node."""
    now = list(current.values())
    rates = [st.samples_per_second for st in now if st.samples_per_second is not None]
    losses = [st.loss for st in now if st.loss is not None]
    totals = [st.total_steps for st in now if st.total_steps is not None]
    saved = [st.last_checkpoint_time for st in statuses.values()
             if st.last_checkpoint_time is not None]
    return {
        "samples_per_second": max(rates, default=None),
        "loss": sum(losses) / len(losses) if losses else None,
        "total_steps": max(totals, default=None),
        "last_checkpoint_at": (datetime.fromtimestamp(max(saved), timezone.utc)
                               if saved else None),
    }


def goodput_fields(statuses: dict[str, JobNodeStatus]) -> dict[str, Any]:
    """JobView's goodput: productive node-seconds over productive + lost, and the lost
    node-seconds by cause, over the nodes' reports (docs/checkpoints.md)."""
    productive = sum(st.productive_seconds or 0.0 for st in statuses.values())
    lost: dict[str, float] = {}
    for st in statuses.values():
        for cause, seconds in st.lost_seconds.items():
            lost[cause] = lost.get(cause, 0.0) + seconds
    spent = productive + sum(lost.values())
    return {"goodput": productive / spent if spent > 0 else None, "lost_seconds": lost}


def job_view(record: JobRecord, statuses: dict[str, JobNodeStatus]) -> JobView:
    """A job as the API shows it: the record joined with its nodes' reports."""
    current = statuses_in_force(record.nodes, statuses)  # record.nodes mirrors assignments
    running = [st.world_size for st in current.values() if st.state == JobNodeState.RUNNING]
    steps = [st.last_step for st in (current or statuses).values() if st.last_step is not None]
    ckpts = [st.last_checkpoint_step for st in statuses.values()
             if st.last_checkpoint_step is not None]
    restarts = dict(record.restarts)
    # What the agents charged since the scheduler last counted it into the record.
    _, rises = restart_charges(record.charged, record.nodes, current)
    for charge in rises:
        restarts[CHARGED_REASON] = restarts.get(CHARGED_REASON, 0) + charge.count - charge.before
    nodes = [
        NodeInJob(
            node_id=node,
            state=current[node].state.value if node in current else "assigned",
            ranks=current[node].ranks if node in current else [],
            devices=current[node].devices if node in current else [],
            last_step=current[node].last_step if node in current else None,
            restart_count=current[node].restart_count if node in current else 0,
        )
        for node in sorted(record.nodes)
    ]
    return JobView(
        job_id=record.job_id,
        spec=SpecView.of(record.spec),
        phase=record.phase,
        cancel_requested=record.cancel_requested,
        conditions=record.conditions,
        world_size=max(running, default=0) if not record.phase.is_terminal() else 0,
        nodes=nodes,
        restarts=restarts,
        restart_count=sum(restarts.values()),
        last_step=max(steps, default=None),
        last_checkpoint_step=max(ckpts, default=None),
        **progress_fields(current, statuses),
        **goodput_fields(statuses),
        exit_reason=record.exit_reason,
        error=record.error,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
    )


def node_views(snap: Snapshot, now: datetime | None = None) -> list[NodeView]:
    """Every live node with its state, the slots and GPUs its jobs hold, those jobs, and
    its ``slow`` mark while it lasts at ``now`` (default: the clock)."""
    view = snap.view
    now = datetime.now(timezone.utc) if now is None else now
    slow = {n: m for n, m in view.slow.items() if m.in_force(now)}
    placed: dict[str, list[str]] = {}
    used: dict[str, int] = {}
    gpus_used: dict[str, int] = {}
    for job_id, per_node in view.assignments.items():
        for node_id, a in per_node.items():
            placed.setdefault(node_id, []).append(job_id)
            used[node_id] = used.get(node_id, 0) + a.nproc_per_node
            gpus_used[node_id] = gpus_used.get(node_id, 0) + a.gpus_per_node
    return [
        NodeView(
            node_id=n.node_id, host=n.host, address=n.address,
            state="draining" if n.node_id in view.draining else "live",
            slots=n.slots, slots_used=used.get(n.node_id, 0), gpus=n.gpus,
            gpus_used=gpus_used.get(n.node_id, 0), gpu_devices=n.gpu_devices,
            labels=n.labels, jobs=sorted(placed.get(n.node_id, [])),
            slow=slow.get(n.node_id),
        )
        for n in sorted(view.nodes.values(), key=lambda n: n.node_id)
    ]
