"""The live resize's decisions at a step boundary, as pure functions.

What a rank contributes to the agreement (:func:`pending_round`), what it does
once the ranks agreed on a round (:func:`decide`), and which rank the new
group takes the state from (:func:`choose_source`). They read no file and no
clock; :class:`checkpoints.live.link.WorkerLink` and
:func:`checkpoints.live.sync.sync_state` act on them. The protocol they serve
is told in :mod:`checkpoints.live`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from checkpoints.protocol.live import ResizeNotice

__all__ = [
    "HOST_WAIT_S",
    "JOINER_WAIT_S",
    "Action",
    "Flags",
    "choose_source",
    "decide",
    "pending_flags",
    "pending_round",
]

#: A group that grows trains on until its joiners wait in the new group, at most this
#: long after a rank saw the notice (then it re-forms and waits for them there, as a
#: group that does not grow always does).
JOINER_WAIT_S = 10.0
#: A rank that does not host the new group's store waits this long after it saw a
#: notice of a growing group for a peer to say it hosts it; if none does (a joiner is
#: the new rank 0), the ranks re-form at once and wait for the joiners there.
HOST_WAIT_S = 0.5


class Action(enum.StrEnum):
    """What a rank does at a step boundary once the ranks agreed on a round."""

    CONTINUE = "continue"
    RESIZE = "resize"
    LEAVE = "leave"


def pending_round(notice: ResizeNotice | None, current_round: int) -> int:
    """The flag a rank contributes: its notice's round if not yet acted on, else 0."""
    if notice is None or notice.round <= current_round:
        return 0
    return notice.round


class Flags(NamedTuple):
    """What a rank contributes to the agreement on the live path (MAX over ranks).

    Attributes:
        go: the round to act on now (:func:`pending_flags`); 0: none.
        host: the round of a growing group whose store this rank hosts (it is the
            new rank 0): the others leave the moment to act to it; 0: none.
    """

    go: int
    host: int


def pending_flags(
    notice: ResizeNotice | None,
    current_round: int,
    *,
    world_size: int,
    hosting: bool,
    joiners_waiting: bool,
    host_said: int,
    waited_s: float,
) -> Flags:
    """What a rank contributes at a step boundary, for a notice it has not acted on.

    A notice that does not grow the group (a leave; a recovery from a lost member,
    which does not pass here) is acted on at once (:func:`pending_round`). A group
    that grows trains on until its joiners wait in the new group: their start
    (forking the worker, the script's imports, up to its ``init_process_group``)
    takes a second or more, which the old group would otherwise spend idle. The
    new rank 0, which opens the new group's store as soon as it sees the notice,
    knows when they do (``joiners_waiting``) and sets ``go``; the others follow it
    (``host_said``: the agreed ``host`` of the last exchange). Where no rank of the
    old group hosts it (a joiner is the new rank 0), they act after
    :data:`HOST_WAIT_S`; anyone acts after :data:`JOINER_WAIT_S`.

    Args:
        notice: this node's newest resize notice.
        current_round: the round this rank last resized into.
        world_size: the current group's size.
        hosting: this rank is the notice's rank 0.
        joiners_waiting: (the host) as many ranks as join wait in its store.
        host_said: the newest round a rank said it hosts (agreed at the last boundary).
        waited_s: how long since this rank first saw the notice.
    """
    round_ = pending_round(notice, current_round)
    if not round_ or notice is None or notice.lost or notice.world_size <= world_size:
        return Flags(round_, 0)
    if hosting:
        return Flags(round_ if joiners_waiting or waited_s >= JOINER_WAIT_S else 0, round_)
    bound = JOINER_WAIT_S if host_said >= round_ else HOST_WAIT_S
    return Flags(round_ if waited_s >= bound else 0, 0)


def decide(
    *, agreed_round: int, current_round: int, leaving: bool, notice_round: int | None
) -> Action:
    """What to do at this boundary.

    Args:
        agreed_round: the MAX over ranks of :func:`pending_round` (0: no rank saw one).
        current_round: the round this rank last resized into (0: none).
        leaving: this rank's node has a leave notice.
        notice_round: the round of this node's resize notice, if any.

    Returns:
        CONTINUE when no newer round was agreed; LEAVE when this node leaves
        and has no notice of the agreed round or later (a node that leaves is
        not in the new round); RESIZE otherwise (the notice may still be on
        its way: :func:`wait_for_notice`).
    """
    if agreed_round <= current_round:
        return Action.CONTINUE
    if leaving and (notice_round is None or notice_round < agreed_round):
        return Action.LEAVE
    return Action.RESIZE


def choose_source(steps: Sequence[int]) -> tuple[int, int]:
    """The rank to take state from: the lowest rank holding the largest step.

    Args:
        steps: each rank's live step, by rank (-1: holds nothing live).

    Returns:
        (source rank, its step); the step is -1 when no rank holds anything.

    Raises:
        ValueError: when ``steps`` is empty.
    """
    if not steps:
        raise ValueError("no ranks to choose a source from")
    top = max(steps)
    return steps.index(top), top
