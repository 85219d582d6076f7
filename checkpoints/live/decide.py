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

from checkpoints.protocol.live import ResizeNotice

__all__ = ["Action", "choose_source", "decide", "pending_round"]


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
