"""Queue accounting within a pass: what each queue holds, may still take, is owed
and borrows (see :mod:`service.api.queues` for the rules, :mod:`service.scheduler.rounds`
for how slots are given out by them).

Slots, not nodes: a job of ``nproc_per_node`` workers holds that many of its
queue's slots on each of its nodes. All of it is read from (and :func:`hold`
writes to) one :class:`~service.scheduler.state.SchedulerPass`.
"""

from __future__ import annotations

from service.api.models import JobRecord
from service.api.queues import QueueSpec
from service.scheduler.state import SchedulerPass
from service.scheduler.types import job_order


def queue_of(p: SchedulerPass, record: JobRecord) -> QueueSpec:
    """The job's queue; one that is gone guarantees nothing and limits nothing."""
    name = record.spec.queue
    return p.queues.get(name) or QueueSpec(name=name, created_at=record.created_at)


def hold(p: SchedulerPass, record: JobRecord, nodes: int) -> None:
    """Count ``nodes`` more (or fewer) nodes of the job against its queue."""
    name = record.spec.queue
    p.used[name] = p.used.get(name, 0) + nodes * record.spec.nproc_per_node


def limit_room(p: SchedulerPass, record: JobRecord) -> int:
    """Slots the job's queue may still take before its limit."""
    queue = queue_of(p, record)
    if queue.limit is None:
        return 1 << 62
    return max(0, queue.limit - p.used.get(queue.name, 0))


def borrowed(p: SchedulerPass, name: str) -> float:
    """Slots the queue holds beyond its guarantee, per unit of weight."""
    queue = p.queues.get(name) or QueueSpec(name=name)
    return max(0, p.used.get(name, 0) - queue.guaranteed) / queue.weight


def claimed(p: SchedulerPass, name: str) -> int:
    """Slots reclaims of this pass made room for, for jobs of the queue."""
    return sum(n for j, n in p.claims.items() if p.view.jobs[j].spec.queue == name)


def ahead(p: SchedulerPass, record: JobRecord) -> int:
    """Slots held by the job and by the jobs before it in its queue's order
    (priority, then submission), and the room reclaims made for those this pass."""
    total = 0
    mine = job_order(record)
    for job_id in p.by_queue.get(record.spec.queue, ()):
        other = p.view.jobs[job_id]
        if job_id == record.job_id or job_order(other) < mine:
            total += len(p.members[job_id]) * other.spec.nproc_per_node
            total += p.claims.get(job_id, 0)
    return total


def owed(p: SchedulerPass, record: JobRecord) -> bool:
    """Whether the job's start is within its queue's guarantee (see
    :func:`service.scheduler.reclaim.reclaim`)."""
    spec = record.spec
    if queue_of(p, record).guaranteed == 0:
        return False
    need = (spec.min_nodes - len(p.members[record.job_id])) * spec.nproc_per_node
    return ahead(p, record) + need <= queue_of(p, record).guaranteed


def share(p: SchedulerPass, record: JobRecord) -> int:
    """Slots of the job's queue's guarantee left for it by the jobs before it
    (in priority, then submission order): what it holds within the guarantee."""
    before = 0
    mine = job_order(record)
    for job_id in p.by_queue.get(record.spec.queue, ()):
        kept = p.members[job_id]
        other = p.view.jobs[job_id]
        if kept and job_order(other) < mine:
            before += len(kept) * other.spec.nproc_per_node
    return max(0, queue_of(p, record).guaranteed - before)
