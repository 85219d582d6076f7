"""The rounds in which a pass gives out free slots, in this order:

1. guarantees: each job that waits within its queue's guarantee starts as a
   gang, else slots are reclaimed for it (:mod:`service.scheduler.reclaim`);
   then running jobs grow within their queue's guarantee;
2. reservations (:func:`reserve`): nodes held for the first job of each queue
   that has waited ``Policy.reserve_after_s`` without fitting;
3. borrowing (:func:`borrow`): idle slots to the queues by weight, the queue
   that borrowed least per weight placing next, off other jobs' reservations.

A job that gave slots back in this pass takes none in any round.
"""

from __future__ import annotations

import math
from datetime import timedelta

from service.api.models import JobRecord
from service.scheduler.placement import grow
from service.scheduler.quota import borrowed, claimed, limit_room, owed, queue_of
from service.scheduler.reclaim import reclaim
from service.scheduler.state import SchedulerPass
from service.scheduler.types import Reservation, waiting_since


def place(p: SchedulerPass, active: list[JobRecord]) -> None:
    """Give out free slots: guarantees first (reclaiming borrowed slots for a
    job that waits within its queue's guarantee), then reservations for jobs
    that waited too long, then idle slots to everyone, shared by weight."""
    for record in active:
        if record.job_id in p.shrunk:
            continue  # it just gave its slots back: it does not take others'
        if p.below_min(record) and owed(p, record) and not grow(
            p, record, to_min_only=True
        ):
            reclaim(p, record)
    for record in active:
        if record.job_id in p.shrunk:
            continue  # it just gave slots back: it does not take others
        room = (queue_of(p, record).guaranteed - p.used.get(record.spec.queue, 0)
                - claimed(p, record.spec.queue))
        if room >= record.spec.nproc_per_node and not p.below_min(record):
            grow(p, record, to_min_only=False, most=room // record.spec.nproc_per_node)
    reserve(p, active)
    borrow(p, active)


def borrow(p: SchedulerPass, active: list[JobRecord]) -> None:
    """Idle slots to the queues by weight: the queue with the fewest borrowed
    slots per weight places next (a gang start, else one node of growth),
    in its own order of priority then submission."""
    gangs: dict[str, list[JobRecord]] = {}
    claiming = {p.view.jobs[j].spec.queue for j in p.claims}
    for record in active:
        # A job that gave its slots back this pass takes none; a queue for which
        # a reclaim made room borrows nothing more until that room is used.
        if record.job_id not in p.shrunk and record.spec.queue not in claiming:
            gangs.setdefault(record.spec.queue, []).append(record)
    growing: dict[str, list[JobRecord]] = {}
    while gangs or growing:
        name = min({*gangs, *growing}, key=lambda q: (borrowed(p, q), q))
        if name in gangs:
            # Free slots only shrink within a pass: a job that did not fit
            # now never will in this pass, so each is tried once.
            jobs = gangs[name]
            while jobs and not (
                p.below_min(jobs[0])
                and grow(p, jobs[0], to_min_only=True, borrowing=True)
            ):
                jobs.pop(0)
            if jobs:
                jobs.pop(0)
                continue
            del gangs[name]
            growing[name] = [
                r for r in active if r.spec.queue == name and r.job_id not in p.shrunk
            ]
            continue
        jobs = growing[name]
        while jobs and not grow(p, jobs[0], to_min_only=False, most=1, borrowing=True):
            jobs.pop(0)
        if not jobs:
            del growing[name]


def reserve(p: SchedulerPass, active: list[JobRecord]) -> None:
    """Reserve nodes for the first job of each queue that has waited
    ``policy.reserve_after_s`` without fitting: the nodes with the most free
    slots among those it could run on, not reserved for another job."""
    if math.isinf(p.policy.reserve_after_s):
        return
    patience = timedelta(seconds=p.policy.reserve_after_s)
    served: set[str] = set()
    for record in active:
        spec = record.spec
        job_id = record.job_id
        if spec.queue in served or not p.below_min(record) or job_id in p.preempted:
            continue
        served.add(spec.queue)  # the first waiting job of its queue, or none
        if p.now - waiting_since(record) < patience:
            continue
        need = spec.min_nodes - len(p.members[job_id])
        if need * spec.nproc_per_node > limit_room(p, record):
            continue
        usable = sorted(
            (n for n, info in p.view.nodes.items()
             if n in p.free and n not in p.reserved
             and info.slots >= spec.nproc_per_node
             and n not in p.members[job_id] and n not in p.left.get(job_id, ())
             and all(info.labels.get(k) == v for k, v in spec.node_selector.items())),
            key=lambda n: (-p.free[n], n),
        )
        if len(usable) < need:
            continue  # it could not run even on an idle cluster (as it is now)
        chosen = usable[:need]
        for node_id in chosen:
            p.reserved[node_id] = (job_id, spec.nproc_per_node)
        p.reservations.append(Reservation(job_id, frozenset(chosen)))
