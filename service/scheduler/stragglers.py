"""Which nodes of a job are stragglers, and what to do about each: a pure decision.

In synchronous data-parallel training every rank waits for the slowest at each
gradient all-reduce, so one slow node (a throttled GPU, a noisy neighbour) drags
the whole job to its pace and nothing fails. The checkpoints library measures
each rank's own *pace*: the seconds it spends computing a step, not waiting for
the others. The runner reports, per node, the pace of its slowest rank for each
recent step; this module compares them.

**The rule.** For each step that every node reported, a node's *ratio* is its
pace over the median pace of the job's *other* nodes at that step (leaving the
node out keeps a two-node job meaningful: neither node is measured against
itself). A node is a straggler when the median of its ratios over the last
``window_steps`` common steps is ``factor`` or more. The median, not the mean:
a node with a few slow steps (a checkpoint, a page fault, a noisy neighbour for
a moment) has most of its ratios near 1 and is never one. A job that is slow as a
whole has every ratio near 1: no straggler. A window not yet full decides nothing.

**The action.** ``report`` reports; ``evict`` drains the node from the job, the
slowest first, but never below ``min_nodes`` (those left are reported, with the
reason); ``off`` looks at nothing. Evictions go through the drain's live path
(nothing lost); the node is kept out of new placements for a cool-down
(:func:`cooling_down`).

**In the pass** (:func:`act_on_stragglers`, after each job kept its usable
nodes and before the rounds place): for a ``RUNNING`` job whose policy is not
``off``, the paces its current nodes report (statuses of their assignments'
generation) are compared. An eviction deletes the node's assignment of this job
(its agent stops the runner, which leaves by the live path, as for a drain), with
a ``straggler_evicted`` event, and writes the node's ``slow`` mark (the ratio,
since, until the cool-down ends; :class:`~service.api.models.SlowMark`) in the
same transaction as the job's change; while it lasts the node keeps its other jobs
but takes no new placement (:func:`service.scheduler.placement.fits`). A report is
a ``straggler_reported`` event, once per node and generation (the job record's
``stragglers`` remembers it), so a pass never repeats it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from rendezvous.records import JobNodeStatus
from service.api.models import EventReason, JobPhase, JobRecord, SlowMark, StragglerPolicy
from service.scheduler.reports import current_statuses
from service.scheduler.state import SchedulerPass

__all__ = [
    "Straggler", "act_on_stragglers", "cooling_down", "find_stragglers", "job_paces",
    "pace_ratios",
]

Action = Literal["evict", "report"]


@dataclass(frozen=True)
class Straggler:
    """A node found slower than the rest of its job.

    Attributes:
        node_id: the node.
        ratio: the median of its pace ratios over the window (>= the policy's factor).
        action: ``evict`` (drain it from the job) or ``report`` (only say so).
        reason: a sentence for the job's events, naming the ratio and the window.
    """

    node_id: str
    ratio: float
    action: Action
    reason: str


def pace_ratios(
    paces: Mapping[str, Mapping[int, float]], window_steps: int
) -> dict[str, float]:
    """Each node's median ratio to the other nodes over the last ``window_steps`` common steps.

    Args:
        paces: per node, per step, the node's pace (seconds; its slowest rank's).
        window_steps: how many of the most recent steps every node reported to use.

    Returns:
        node -> median ratio; empty when fewer than two nodes or fewer than
        ``window_steps`` common steps were reported (too early to tell).
    """
    if len(paces) < 2:
        return {}
    common = set.intersection(*(set(steps) for steps in paces.values()))
    window = sorted(common)[-window_steps:]
    if len(window) < window_steps:
        return {}
    ratios: dict[str, list[float]] = {node: [] for node in paces}
    for step in window:
        at_step = {node: steps[step] for node, steps in paces.items()}
        for node, pace in at_step.items():
            others = statistics.median(p for n, p in at_step.items() if n != node)
            if others > 0:
                ratios[node].append(pace / others)
    return {node: statistics.median(values) for node, values in ratios.items() if values}


def find_stragglers(
    paces: Mapping[str, Mapping[int, float]],
    policy: StragglerPolicy,
    *,
    members: int,
    min_nodes: int,
) -> list[Straggler]:
    """The job's stragglers under ``policy``, slowest first, each with what to do.

    Args:
        paces: per node of the job's current round, per step, the node's pace.
        policy: the job's straggler policy.
        members: how many nodes the job runs on now.
        min_nodes: the job's minimum: evictions never take it below.

    Returns:
        One :class:`Straggler` per node at or over the factor; ``evict`` for as
        many of the slowest as the job can lose, ``report`` for the rest (and
        for all of them under the ``report`` policy); empty under ``off``.
    """
    if policy.mode == "off":
        return []
    ratios = pace_ratios(paces, policy.window_steps)
    slow = sorted(((r, n) for n, r in ratios.items() if r >= policy.factor), reverse=True)
    room = max(0, members - min_nodes) if policy.mode == "evict" else 0
    found = []
    for i, (ratio, node) in enumerate(slow):
        evict = i < room
        why = (f"node {node}'s steps took {ratio:.2f}x the median of the job's other nodes "
               f"over the last {policy.window_steps} steps (the policy's factor is "
               f"{policy.factor:g})")
        if not evict and policy.mode == "evict":
            why += f"; kept: the job is at its minimum of {min_nodes} nodes"
        found.append(Straggler(node, ratio, "evict" if evict else "report", why))
    return found


def cooling_down(marked_at: datetime | None, *, now: datetime, cooldown_s: float) -> bool:
    """Whether a node marked slow at ``marked_at`` is still kept out of new placements."""
    return marked_at is not None and now - marked_at < timedelta(seconds=cooldown_s)


def job_paces(reports: Mapping[str, JobNodeStatus]) -> dict[str, dict[int, float]]:
    """Per node, per step, the pace its status reports (``JobNodeStatus.paces``)."""
    return {node: dict(st.paces) for node, st in reports.items()}


def act_on_stragglers(p: SchedulerPass, record: JobRecord) -> None:
    """Evict or report the job's stragglers, in this pass (see the module's docstring)."""
    policy = record.spec.straggler_policy
    job_id = record.job_id
    kept = p.members[job_id]
    if policy.mode == "off" or record.phase != JobPhase.RUNNING or len(kept) < 2:
        _forget_reports(p, record, kept)
        return
    reports = current_statuses(kept, p.view.statuses.get(job_id, {}))
    found = []
    if len(reports) == len(kept):  # every node of the round reports: compare them
        found = find_stragglers(job_paces(reports), policy, members=len(kept),
                                min_nodes=record.spec.min_nodes)
    for straggler in found:
        if straggler.action == "evict":
            _evict(p, record, straggler)
        else:
            _report(p, record, straggler)
    _forget_reports(p, record, kept)


def _evict(p: SchedulerPass, record: JobRecord, straggler: Straggler) -> None:
    """Take the node out of the job (as a drain does) and mark it slow for the cool-down."""
    job_id, node_id = record.job_id, straggler.node_id
    assignment = p.members[job_id].pop(node_id)
    p.adjust(node_id, assignment.nproc_per_node)
    change = p.change(job_id)
    change.delete.append(node_id)
    mark = SlowMark(
        node_id=node_id, job_id=job_id, ratio=round(straggler.ratio, 3), since=p.now,
        until=p.now + timedelta(seconds=p.policy.straggler_cooldown_s),
    )
    change.slow[node_id] = p.slow[node_id] = mark
    p.count_restart(job_id, EventReason.STRAGGLER_EVICTED)
    p.event(job_id, EventReason.STRAGGLER_EVICTED,
            f"evicted {node_id}, a straggler: {straggler.reason}", [node_id])


def _report(p: SchedulerPass, record: JobRecord, straggler: Straggler) -> None:
    """Say once per node and generation that it is a straggler."""
    job_id, node_id = record.job_id, straggler.node_id
    generation = p.members[job_id][node_id].generation
    current = p.changes[job_id].record if job_id in p.changes else record
    if current.stragglers.get(node_id) == generation:
        return  # said already
    p.change(job_id).record.stragglers[node_id] = generation
    p.event(job_id, EventReason.STRAGGLER_REPORTED,
            f"{node_id} is a straggler: {straggler.reason}", [node_id])


def _forget_reports(p: SchedulerPass, record: JobRecord, kept: Mapping[str, object]) -> None:
    """Drop the remembered reports of nodes that are no longer in the job."""
    job_id = record.job_id
    current = p.changes[job_id].record if job_id in p.changes else record
    stale = [n for n in current.stragglers if n not in kept]
    if stale:
        reported = p.change(job_id).record.stragglers
        for node_id in stale:
            del reported[node_id]
