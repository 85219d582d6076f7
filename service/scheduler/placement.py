"""Placing a job on nodes: which nodes it may get (:func:`fits`, the one home of the
node selector and GPU rules) and giving it nodes toward its minimum, as a gang,
or toward its maximum (:func:`grow`).

Which job is placed when is :mod:`service.scheduler.rounds`'s business; taking
slots back from running jobs is :mod:`service.scheduler.reclaim`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rendezvous.gpus import gpus_free
from rendezvous.records import Assignment
from service.api.models import JobRecord
from service.scheduler.quota import hold, limit_room
from service.scheduler.state import SchedulerPass


def fits(
    p: SchedulerPass, record: JobRecord, node_id: str, free: Mapping[str, int] | None = None,
    placed: Iterable[Mapping[str, Assignment]] | None = None,
) -> bool:
    """Whether ``record``'s job may get a node on ``node_id`` (given ``free`` slots
    and the jobs' ``placed`` assignments, for a reclaim's what-if)."""
    free = p.free if free is None else free
    placed = p.members.values() if placed is None else placed
    info = p.view.nodes[node_id]
    selector = record.spec.node_selector
    return (
        node_id in free
        and free[node_id] >= record.spec.nproc_per_node
        and node_id not in p.members[record.job_id]
        # A node whose runner just left this job is live and has free slots
        # again, but giving it back in this pass would put and delete the same
        # key in one transaction, which etcd refuses ("duplicate key given in
        # txn request"), failing every pass from then on. The next pass, when
        # the report belongs to no assignment, may assign it again.
        and node_id not in p.left.get(record.job_id, ())
        # A straggler cooling down keeps its jobs but takes no new one
        # (service.scheduler.stragglers).
        and node_id not in p.slow
        and all(info.labels.get(k) == v for k, v in selector.items())
        # GPUs: healthy ones no job placed here asks for (rendezvous.gpus).
        and (record.spec.gpus_per_node == 0 or gpus_free(
            info, node_id, placed) >= record.spec.gpus_per_node)
    )


def reserved_away(p: SchedulerPass, node_id: str, record: JobRecord) -> bool:
    """Whether the job would take slots of ``node_id`` reserved for another job."""
    held = p.reserved.get(node_id)
    if held is None or held[0] == record.job_id:
        return False
    return p.free[node_id] - held[1] < record.spec.nproc_per_node


def grow(
    p: SchedulerPass, record: JobRecord, *, to_min_only: bool, most: int | None = None,
    borrowing: bool = False,
) -> int:
    """Place the job toward its minimum (all of it or nothing) or its maximum.

    Args:
        most: place at most this many nodes (growth only).
        borrowing: the placement goes beyond the queue's guarantee: it
            stays off nodes reserved for another job.

    Returns:
        How many nodes were placed.
    """
    job_id = record.job_id
    kept = p.members[job_id]
    spec = record.spec
    target = spec.min_nodes if to_min_only else spec.max_nodes
    want = target - len(kept)
    if not to_min_only and most is not None:
        want = min(want, most)
    # The queue's limit, in nodes of this job: all of a gang or nothing.
    room = limit_room(p, record) // spec.nproc_per_node
    if to_min_only and room < want:
        return 0
    want = min(want, room)
    if want <= 0:
        return 0
    if not to_min_only and len(kept) < spec.min_nodes:
        # The gang step could not give this job its minimum; growth must not
        # give it part of it either (it would hold nodes while PENDING).
        return 0
    if not any(free >= spec.nproc_per_node for free in p.open.values()):
        return 0  # nothing fits anywhere: skip the scan (2,000 pending jobs on a full cluster)
    candidates = sorted(
        (n for n in p.open if fits(p, record, n)
         and p.held.get(n, job_id) == job_id
         and not (borrowing and reserved_away(p, n, record))),
        key=lambda n: (-p.free[n], n),
    )
    if to_min_only and len(candidates) < want:
        return 0  # gang: all of the minimum or nothing
    chosen = candidates[:want]
    if not chosen:
        return 0
    _place_on(p, record, chosen, gang=to_min_only)
    return len(chosen)


def _place_on(p: SchedulerPass, record: JobRecord, chosen: list[str], *, gang: bool) -> None:
    """Give the job new assignments on ``chosen`` (its gang start, or growth)."""
    job_id = record.job_id
    kept = p.members[job_id]
    hold(p, record, len(chosen))
    for node_id in chosen:
        kept[node_id] = p.new_assignment(job_id)
        p.change(job_id).put[node_id] = kept[node_id]
        p.adjust(node_id, -record.spec.nproc_per_node)
    if gang:
        p.gangs[job_id] = (sorted(chosen), len(kept))
        for node_id in [n for n, held in p.reserved.items() if held[0] == job_id]:
            del p.reserved[node_id]  # it got its nodes
    else:
        p.grown.setdefault(job_id, []).extend(chosen)
