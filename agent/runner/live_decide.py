"""The runner's decisions on the live path: can the group take it, is a resize or a leave done.

For a planned membership change (a node joins, or leaves because it is drained,
scaled down or reclaimed) the workers are healthy: instead of stopping them,
the runner forms the next rendezvous round while they train, then tells them
the new membership, and they re-form their process group at a step boundary.
The files the runner and its workers exchange, and their formats, have one
home: :mod:`checkpoints.protocol.live` (the notices ``live-resize.json`` and
``live-leave.json``, each worker's ``live-<local_rank>.json``), which the
runner reads and writes through. What the runner decides from them is here,
as pure functions of the workers' answers, their liveness and the clock;
:class:`agent.runner.elastic.TidalElasticAgent` acts on them. Whatever goes wrong
falls back to the restart path, and the runner says which path it took and
why (:mod:`agent.runner.status`: the causes are :data:`agent.runner_metrics.FALLBACK_CAUSES`).

This module is the runner's; it imports no torch (nor does the files' home).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from agent.runner_metrics import (
    MEMBERSHIP_CHANGED,
    NO_PEER_STAYS,
    NOT_CAPABLE,
    TIMEOUT,
    WORKER_EXITED,
)
from checkpoints.protocol.live import LiveState, WorkerLive, read_worker_live

# Outcomes that are not a fallback.
WAITING = "waiting"
DONE = "done"
# A planned resize during which a worker caught a failed collective: a member of the
# old group died meanwhile, and the round the runner formed is to be taken in place.
LOST_MEANWHILE = "lost_meanwhile"


def read_workers(progress_dir: Path, local_ranks: Collection[int]) -> dict[int, WorkerLive]:
    """The answers of this node's workers, by local rank (missing or malformed ones left out)."""
    found = {}
    for local_rank in local_ranks:
        worker = read_worker_live(progress_dir, local_rank)
        if worker is not None:
            found[local_rank] = worker
    return found


def blocker(
    workers: Mapping[int, WorkerLive], local_ranks: Collection[int], alive: Callable[[int], bool],
    *, lost: bool = False,
) -> str | None:
    """Why this node's group cannot take the live path now; None if it can.

    It can when every local worker announced the live path (``ready``, or
    ``resized`` into an earlier round) from a process that still runs: a script
    that does not use the library, or one still starting, has no file. For a
    member ``lost`` (in-place recovery), a worker that already caught the failed
    collective and says ``broken`` (waiting for the runner's next round) can too,
    as can one on its way into a planned resize (``resizing``).
    """
    if not local_ranks:
        return NOT_CAPABLE
    states = (LiveState.READY, LiveState.RESIZED, LiveState.RESIZING, LiveState.BROKEN) if lost \
        else (LiveState.READY, LiveState.RESIZED)
    for local_rank in local_ranks:
        worker = workers.get(local_rank)
        if worker is None or worker.state not in states or not alive(worker.pid):
            return NOT_CAPABLE
    return None


def caught_failure(workers: Mapping[int, WorkerLive], local_ranks: Collection[int]) -> bool:
    """Whether a local worker caught a failed collective and waits for the notice of
    a round marked lost (it says ``broken``): a member of its group is gone, whatever
    change the runner saw first."""
    return any((w := workers.get(lr)) is not None and w.state == LiveState.BROKEN
               for lr in local_ranks)


def may_hold_the_dead(members: frozenset[str], new_members: frozenset[str],
                      leaving: frozenset[str]) -> bool:
    """After a member's death that the workers caught (a failed collective) but no
    change reported: whether the round just formed may still hold the dead member.

    It may when it left out none of the old round's members but those that
    announced a leave (``members`` before, ``new_members`` now): the leader formed
    it before it knew of the death. A round that left out another member formed
    after the death (or the dead was a leaver whose workers were stopped).
    """
    return not (members - new_members - leaving)


def resize_outcome(
    workers: Mapping[int, WorkerLive], local_ranks: Collection[int], round_: int, *,
    exited: bool, superseded: bool, now: float, deadline: float,
    ack_deadline: float | None = None, planned: bool = False,
) -> str:
    """Where a live resize into ``round_`` stands on this node.

    Args:
        workers: the workers' answers, by local rank.
        local_ranks: this node's workers.
        round_: the round the runner told them.
        exited: a worker process of the group is gone.
        superseded: the round is obsolete already (a member lost, or the
            others went on without this node).
        now / deadline: the runner's clock and when it gives up.
        ack_deadline: for an in-place recovery (a member lost), when every
            worker must have caught its failed collective (said ``resizing``,
            or ``resized`` into ``round_``): one still blocked (a peer that
            hangs without closing its sockets, which gloo cannot cut short)
            is not waited for until ``deadline``.
        planned: the resize is a planned one (a join or a leave): a worker that
            caught a failed collective meanwhile (``broken``) waits for a notice
            marked lost, which this round's is not yet.

    Returns:
        :data:`DONE` once every worker says ``resized`` into ``round_`` (or
        later), :data:`WAITING` while it may still come, :data:`LOST_MEANWHILE`
        when a planned resize met a member's death (the runner marks the round
        lost and waits again), else the fallback cause: ``worker_exited``,
        ``membership_changed`` or ``timeout``.
    """
    if local_ranks and all(
        (w := workers.get(lr)) is not None and w.state == LiveState.RESIZED and w.round >= round_
        for lr in local_ranks
    ):
        return DONE
    if exited:
        return WORKER_EXITED
    if superseded:
        return MEMBERSHIP_CHANGED
    if planned and caught_failure(workers, local_ranks):
        return LOST_MEANWHILE
    if now >= deadline:
        return TIMEOUT
    if ack_deadline is not None and now >= ack_deadline and not all(
        (w := workers.get(lr)) is not None and (
            w.state in (LiveState.BROKEN, LiveState.RESIZING)
            or (w.state == LiveState.RESIZED and w.round >= round_))
        for lr in local_ranks
    ):
        return TIMEOUT
    return WAITING


def leave_outcome(
    workers: Mapping[int, WorkerLive], pids: Mapping[int, int], alive: Callable[[int], bool],
    *, peers_stay: bool, now: float, deadline: float,
) -> str:
    """Where a planned leave stands: the runner waits for its workers to exit.

    Args:
        workers: the workers' answers, by local rank.
        pids: the worker processes the runner started, by local rank.
        alive: whether a process id still runs.
        peers_stay: another member of the round stays (one that neither left
            nor announced a leave): someone the workers can resize with.
        now / deadline: the runner's clock and when it gives up.

    Returns:
        :data:`DONE` once every worker exited having said ``left``,
        :data:`WAITING` while they train on, ``worker_exited`` when one
        exited without leaving (it failed: the others will not resize the
        live way), ``no_peer_stays`` when no worker left yet and every other
        member leaves too (a cancel: nobody will resize), ``membership_changed``
        when a worker caught a failed collective (a member died: the group
        cannot agree on the step to leave at; the others recover in place without
        this node), ``timeout`` past ``deadline``.
    """
    gone = {lr for lr, pid in pids.items() if not alive(pid)}
    left = {lr for lr, w in workers.items() if w.state == LiveState.LEFT}
    if gone - left:
        return WORKER_EXITED
    if caught_failure(workers, pids):
        return MEMBERSHIP_CHANGED
    if pids and gone == set(pids):
        return DONE
    if not peers_stay and not left:
        return NO_PEER_STAYS
    if now >= deadline:
        return TIMEOUT
    return WAITING
