"""Reclaim: taking slots back from running jobs for a job that waits within its
queue's guarantee (shrinking elastic jobs toward their minimum, then preempting
whole jobs), and holding the slots freed for it.

Nothing is taken unless the waiting job then fits (:func:`fits_after`, a
what-if over the pass's free slots and placements), and no more is taken than
it needs (:func:`minimal`). The victims get their assignments deleted and an
event (``reclaimed``, or ``preempted`` with the job back to ``PENDING``); the
slots freed stay taken in this pass (:attr:`SchedulerPass.held`), and the
waiting job starts on them in the next one.
"""

from __future__ import annotations

from service.api.models import EventReason, JobPhase, JobRecord
from service.scheduler.placement import fits
from service.scheduler.quota import borrowed, claimed, hold, queue_of, share
from service.scheduler.state import SchedulerPass
from service.scheduler.types import Reclaim, names

#: A step of a reclaim: a victim and the nodes it gives back.
Step = tuple[JobRecord, list[str]]


def reclaim(p: SchedulerPass, waiter: JobRecord) -> None:
    """Take slots back for a job that waits within its queue's guarantee.

    From other queues, at most what its queue is owed (its guarantee less
    what it holds), and only slots those queues hold beyond their own
    guarantees; from its own queue, from jobs of lower priority. First by
    shrinking elastic jobs toward their minimum, one node at a time, then
    by preempting whole jobs; lowest priority first, newest first. Nothing
    is taken unless the job then fits; the slots freed are held for it
    (nobody gets them in this pass; it starts in the next one).
    """
    queue = queue_of(p, waiter)
    owed = max(0, queue.guaranteed - p.used.get(queue.name, 0) - claimed(p, queue.name))
    victims = [  # a job gives slots back once a pass
        p.view.jobs[j] for j, kept in p.members.items()
        if kept and j != waiter.job_id and j not in p.shrunk
        and not p.below_min(p.view.jobs[j])
    ]

    def cross(v: JobRecord) -> bool:
        return v.spec.queue != queue.name

    def eligible(v: JobRecord) -> bool:
        if cross(v):
            return owed > 0 and share(p, v) < len(p.members[v.job_id]) * (
                v.spec.nproc_per_node)
        return v.spec.priority < waiter.spec.priority

    victims = [v for v in victims if eligible(v)]
    victims.sort(key=lambda v: (not cross(v), -borrowed(p, v.spec.queue),
                                v.spec.priority, -v.created_at.timestamp(), v.job_id))
    steps: list[Step] = []
    taken = 0  # slots from other queues
    for v in victims:  # shrinks
        kept = p.members[v.job_id]
        nproc = v.spec.nproc_per_node
        floor = v.spec.min_nodes
        if cross(v):
            floor = max(floor, -(-share(p, v) // nproc))
        spare = len(kept) - floor
        others = [per_node for j, per_node in p.members.items() if j != v.job_id]
        useful = sorted(  # nodes the waiter could use were this victim not there
            (n for n in kept
             if fits(p, waiter, n, {n: p.view.nodes[n].slots}, others)),
            key=lambda n: (-kept[n].generation, n),
        )
        for node_id in useful[:max(0, spare)]:
            if cross(v) and taken >= owed:
                break
            steps.append((v, [node_id]))
            taken += nproc if cross(v) else 0
            if fits_after(p, waiter, steps):
                commit_reclaim(p, waiter, minimal(p, waiter, steps))
                return
    for v in reversed(victims):  # preemptions: lowest priority, newest first
        if cross(v) and (taken >= owed or share(p, v) >= v.spec.min_nodes * (
                v.spec.nproc_per_node)):
            continue  # within its guarantee at its minimum: shrink only
        steps.append((v, sorted(p.members[v.job_id])))
        taken += len(p.members[v.job_id]) * v.spec.nproc_per_node if cross(v) else 0
        if fits_after(p, waiter, steps):
            commit_reclaim(p, waiter, minimal(p, waiter, steps))
            return


def fits_after(p: SchedulerPass, waiter: JobRecord, steps: list[Step]) -> bool:
    """Whether the job's gang fits once the nodes of ``steps`` are released."""
    free = dict(p.free)
    released: dict[str, set[str]] = {}
    for v, nodes in steps:
        for node_id in set(nodes) - released.get(v.job_id, set()):
            free[node_id] = free.get(node_id, 0) + v.spec.nproc_per_node
        released.setdefault(v.job_id, set()).update(nodes)
    placed = [
        {n: a for n, a in per_node.items() if n not in released.get(job_id, ())}
        for job_id, per_node in p.members.items()
    ]
    need = waiter.spec.min_nodes - len(p.members[waiter.job_id])
    limit = queue_of(p, waiter).limit
    if limit is not None:  # the waiter's queue's limit, once its own victims shrank
        given_back = sum(len(nodes) * p.view.jobs[j].spec.nproc_per_node
                         for j, nodes in released.items()
                         if p.view.jobs[j].spec.queue == waiter.spec.queue)
        held = p.used.get(waiter.spec.queue, 0) - given_back
        if held + claimed(p, waiter.spec.queue) + need * waiter.spec.nproc_per_node > limit:
            return False
    return sum(1 for n in free if fits(p, waiter, n, free, placed)) >= need


def hold_room(p: SchedulerPass, waiter: JobRecord, steps: list[Step]) -> None:
    """Hold the nodes the waiter will start on (freed by ``steps``, or free now)
    for it: nobody else is placed on them in this pass."""
    free = dict(p.free)
    released: set[str] = set()
    for v, nodes in steps:
        for node_id in set(nodes):
            free[node_id] = free.get(node_id, 0) + v.spec.nproc_per_node
        released.update(nodes)
    gone: dict[str, set[str]] = {}
    for v, nodes in steps:
        gone.setdefault(v.job_id, set()).update(nodes)
    placed = [{n: a for n, a in per_node.items() if n not in gone.get(job_id, ())}
              for job_id, per_node in p.members.items()]
    need = waiter.spec.min_nodes - len(p.members[waiter.job_id])
    usable = sorted((n for n in free if fits(p, waiter, n, free, placed)),
                    key=lambda n: (n not in released, -free[n], n))
    for node_id in usable[:need]:
        p.held[node_id] = waiter.job_id


def minimal(p: SchedulerPass, waiter: JobRecord, steps: list[Step]) -> list[Step]:
    """``steps`` without those the job fits without (latest kept: it made it fit)."""
    kept = list(steps)
    for i in range(len(kept) - 2, -1, -1):
        trial = kept[:i] + kept[i + 1:]
        if fits_after(p, waiter, trial):
            kept = trial
    return kept


def commit_reclaim(p: SchedulerPass, waiter: JobRecord, steps: list[Step]) -> None:
    """Take the nodes of ``steps`` from their jobs and hold the room for ``waiter``."""
    released: dict[str, set[str]] = {}
    for v, nodes in steps:
        released.setdefault(v.job_id, set()).update(nodes)
    hold_room(p, waiter, steps)
    spec = waiter.spec
    p.claims[waiter.job_id] = (
        (spec.min_nodes - len(p.members[waiter.job_id])) * spec.nproc_per_node)
    for job_id, release in sorted(released.items()):
        _give_back(p, waiter, p.view.jobs[job_id], sorted(release))


def _give_back(p: SchedulerPass, waiter: JobRecord, v: JobRecord, nodes: list[str]) -> None:
    """Victim ``v`` gives ``nodes`` back for ``waiter``: shrunk, or preempted whole
    when it is left below its minimum."""
    job_id = v.job_id
    queue = waiter.spec.queue
    kept = p.members[job_id]
    before = len(kept)
    for node_id in nodes:
        del kept[node_id]  # its slots stay taken: they are held for the waiter
    hold(p, v, -len(nodes))
    change = p.change(job_id)
    change.delete.extend(sorted(nodes))
    change.reclaimed_for = waiter.job_id
    if v.spec.queue != queue:
        why = (f"for job {waiter.job_id} of queue {queue}, which is below its "
               f"guarantee of {queue_of(p, waiter).guaranteed} slot(s)")
    else:
        why = (f"for job {waiter.job_id} of the same queue, of higher priority "
               f"({waiter.spec.priority} > {v.spec.priority})")
    preempted = len(kept) < v.spec.min_nodes
    p.shrunk.add(job_id)
    p.reclaims.append(Reclaim(job_id, waiter.job_id, tuple(sorted(nodes)), preempted,
                              v.spec.queue != queue))
    if preempted:
        p.preempted.add(job_id)
        rest = sorted(kept)
        change.delete.extend(rest)
        hold(p, v, -len(rest))
        for node_id in rest:  # not needed by the waiter: free for others
            p.adjust(node_id, v.spec.nproc_per_node)
        kept.clear()
        p.count_restart(job_id, EventReason.PREEMPTED)
        p.set_phase(job_id, JobPhase.PENDING, EventReason.PREEMPTED,
                    f"preempted {why}; it resumes from its checkpoint when "
                    f"slots are free")
    else:
        p.count_restart(job_id, EventReason.RECLAIMED)
        p.event(job_id, EventReason.RECLAIMED,
                f"shrunk from {before} to {len(kept)} node(s), releasing "
                f"{names(nodes)}, {why}", sorted(nodes))
