"""The runner's restart decisions: what a failure or a membership change costs, and what comes next.

torch's ``LocalElasticAgent`` charges every restart of the worker group to
the job's ``max_restarts``. A dead peer makes the survivors' workers fail, so
a job would spend its budget on nodes coming and going. tidal's runner
charges the job's *worker-failure budget* only for a failure after which the
rendezvous round has the same members as before; a membership change (a node
lost, joined or leaving) is never charged, and a planned one (a node joins or
announces its leave) is taken live when the workers can (:mod:`agent.runner.live_decide`).

These are pure functions of the rounds' members, the budget, the change's
kind and what the live path answered; each returns a :class:`Step`.
:class:`agent.runner.elastic.TidalElasticAgent` computes one where its monitor loop
meets an event and carries it out:

* :func:`after_failure`: the group failed and the next round formed: restart
  uncharged (the members changed), restart charged, or fail (budget spent);
* :func:`for_change`: the round is obsolete while the group is healthy: take
  the live path, fall back to a restart with the grace to save (a planned
  change the workers cannot take live), recover in place (a peer lost, and the
  workers can re-form without it: they keep their processes), or restart a
  broken group (a peer lost and the workers cannot, or the round superseded);
* :func:`after_live`: the live path answered: done, or fall back to a restart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from agent.runner.live_decide import DONE as LIVE_DONE
from agent.runner_metrics import MEMBERSHIP_CHANGED
from rendezvous.elastic.assigned_rounds import LEAVING, LOST, WAITING
from rendezvous.records import RestartReason

#: Changes of a healthy group (:data:`rendezvous.elastic.assigned_rounds.CHANGE_KINDS`): the live
#: path is tried for these; the others (a member lost, the round superseded) broke the group.
PLANNED = (WAITING, LEAVING)


class Action(str, Enum):
    """What the runner does next."""

    RESTART = "restart"  # restart the group, not charged: the membership changed
    RESTART_CHARGED = "restart_charged"  # restart the group, one off the budget
    FAIL = "fail"  # the group failed and the budget is spent: the job fails here
    LIVE = "live"  # the live path: the workers resize in place, nothing restarts
    FALL_BACK = "fall_back"  # a planned change takes the restart path after all


@dataclass(frozen=True)
class Step:
    """A decision: the action, what it costs, and how the runner reports and carries it out.

    Attributes:
        action: what the runner does next.
        budget: the worker-failure budget after this step (never below zero).
        charged: the step took one off the budget.
        broken: the group is stuck in a collective that will not complete:
            stop it at once (no grace period to checkpoint).
        reason: what the restart is counted as, where it is known already.
        resize: the membership change's reason label ("join", "leave" or
            "lost", :data:`agent.runner_metrics.RESIZE_REASONS`); None for a
            failure with the same members.
        fallback: why a change took the restart path (a fallback cause).
        rejoin: the round just formed is obsolete already: form another
            before restarting.
    """

    action: Action
    budget: int
    charged: bool = False
    broken: bool = False
    reason: RestartReason | None = None
    resize: str | None = None
    fallback: str | None = None
    rejoin: bool = False


def resize_reason(kind: str) -> str:
    """A membership change's reason label (agent.runner_metrics.RESIZE_REASONS) from its kind."""
    return {WAITING: "join", LEAVING: "leave"}.get(kind, "lost")


def membership_reason(old: frozenset[str], new: frozenset[str]) -> RestartReason | None:
    """Why a restart happened, judged by the rounds' members: None if they are the same.

    A peer that vanished makes the survivors' workers fail and, seen from
    another survivor, shows up as a node "waiting to join" (the survivor that
    noticed first re-joins). Only the membership diff tells the two apart.
    """
    if not old or not new or old == new:
        return None
    if old - new and new - old:
        return RestartReason.MEMBERSHIP_CHANGED
    return RestartReason.NODE_LOST if old - new else RestartReason.NODE_JOINED


def restart_reason(kind: str, old: frozenset[str], new: frozenset[str]) -> RestartReason:
    """What a restart for a change of ``kind`` counts as, once the new round formed.

    The members' diff says it where it can; else the change's kind (a node
    waiting: joined; any other: lost).
    """
    default = RestartReason.NODE_JOINED if kind == WAITING else RestartReason.NODE_LOST
    return membership_reason(old, new) or default


def after_failure(budget: int, old: frozenset[str], new: frozenset[str]) -> Step:
    """The worker group failed (or lost a peer) and the next round formed: what now.

    Args:
        budget: the worker-failure budget left (at least zero).
        old / new: the members of the round the group ran in and of the new one.

    Returns:
        :attr:`Action.RESTART` when the members changed (not charged: a peer
        left or joined), else :attr:`Action.RESTART_CHARGED` while budget is
        left, else :attr:`Action.FAIL`.
    """
    budget = max(0, budget)
    reason = membership_reason(old, new)
    if reason is not None:
        resize = "join" if reason == RestartReason.NODE_JOINED else "lost"
        return Step(Action.RESTART, budget, broken=True, reason=reason, resize=resize)
    if budget > 0:
        return Step(Action.RESTART_CHARGED, budget - 1, charged=True, broken=True,
                    reason=RestartReason.WORKER_FAILED)
    return Step(Action.FAIL, 0, broken=True, reason=RestartReason.WORKER_FAILED)


def for_change(kind: str, budget: int, blocker: Callable[[], str | None]) -> Step:
    """This node's round is obsolete (a :class:`~rendezvous.elastic.assigned_rounds.Change`) while
    its group is healthy: what now. Never charged.

    Args:
        kind: the change's kind.
        budget: the worker-failure budget left, unchanged.
        blocker: why the group cannot take the live path now
            (:func:`agent.runner.live_decide.blocker`), None if it can; asked for a
            planned change and for a member lost.

    Returns:
        :attr:`Action.LIVE` for a planned change the group can take live, and
        for a member lost when the workers can recover in place (``broken``
        False: they keep their processes; the old group is abandoned, not
        drained); :attr:`Action.FALL_BACK` (with the cause, the workers keep
        their grace) for a planned change it cannot take live;
        :attr:`Action.RESTART` of a broken group for a member lost that the
        workers cannot recover from in place (with the cause) or the round
        superseded (this node was cut off: it is fenced and restarts).
    """
    budget = max(0, budget)
    resize = resize_reason(kind)
    if kind not in PLANNED and kind != LOST:
        return Step(Action.RESTART, budget, broken=True, resize=resize)
    cause = blocker()
    if cause is None:
        return Step(Action.LIVE, budget, resize=resize)
    if kind == LOST:
        return Step(Action.RESTART, budget, broken=True, resize=resize, fallback=cause)
    return Step(Action.FALL_BACK, budget, resize=resize, fallback=cause)


def after_live(kind: str, budget: int, outcome: str) -> Step:
    """The live path for a change of ``kind`` answered ``outcome``: what now. Never charged.

    Returns:
        :attr:`Action.LIVE` once it is done (:data:`agent.runner.live_decide.DONE`), else
        :attr:`Action.FALL_BACK` with ``outcome`` as the cause: the group is
        stopped at once (its workers may be half way through re-forming it),
        after another round is formed if another change made this one
        obsolete meanwhile.
    """
    budget = max(0, budget)
    resize = resize_reason(kind)
    if outcome == LIVE_DONE:
        return Step(Action.LIVE, budget, resize=resize)
    return Step(Action.FALL_BACK, budget, broken=True, resize=resize, fallback=outcome,
                rejoin=outcome == MEMBERSHIP_CHANGED)
