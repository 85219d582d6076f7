"""The assigned rendezvous's records and its pure decisions about rounds.

:class:`rendezvous.elastic.assigned.AssignedRendezvousHandler` keeps, under one lock,
a view of the rendezvous: every node's :class:`JoinRecord`, the last completed
:class:`RoundRecord`, the round this node is in, the members lost since and
the incarnations known dead. What it concludes from that view is here, as
pure functions of it: the rank order of a new round (:func:`order_members`),
whether this node's round is obsolete and why (:func:`pending_change`), and
whom a planned leave can resize with (:func:`staying_peers`). The handler
reads etcd, probes and acts; these are unit tested without either.

This module imports neither torch nor etcd: the records are plain JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.keys import validate_id


@dataclass(frozen=True)
class Member:
    """A node as the rendezvous knows it: where its liveness port listens."""

    node: str
    addr: str
    port: int
    incarnation: str

    def to_dict(self) -> dict[str, object]:
        return {"node": self.node, "addr": self.addr, "port": self.port,
                "incarnation": self.incarnation}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Member:
        return cls(node=validate_id(str(data["node"]), what="node id"), addr=str(data["addr"]),
                   port=int(data["port"]), incarnation=str(data["incarnation"]))  # type: ignore[call-overload]


@dataclass(frozen=True)
class JoinRecord:
    """A node's wish to be in round ``round`` (or a later one).

    ``leaving``: the node is on its way out (a planned leave: its assignment
    was removed and its workers wait for the others to resize without them).
    Such a record makes no round wait and is never a member of a new one.
    """

    member: Member
    round: int
    leaving: bool = False

    def to_json(self) -> bytes:
        data: dict[str, object] = {"round": self.round, **self.member.to_dict()}
        if self.leaving:
            data["leaving"] = True
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> JoinRecord:
        raw = json.loads(data)
        return cls(member=Member.from_dict(raw), round=int(raw["round"]),
                   leaving=raw.get("leaving", False) is True)


@dataclass(frozen=True)
class RoundRecord:
    """A completed round: its number and its members in rank order."""

    round: int
    members: tuple[Member, ...]

    def nodes(self) -> tuple[str, ...]:
        return tuple(m.node for m in self.members)

    def to_json(self) -> bytes:
        return json.dumps(
            {"round": self.round, "members": [m.to_dict() for m in self.members]}
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RoundRecord:
        raw = json.loads(data)
        return cls(round=int(raw["round"]),
                   members=tuple(Member.from_dict(m) for m in raw["members"]))


@dataclass(frozen=True)
class Fence:
    """The assignment a join record is valid under: its key and generation."""

    key: str
    generation: int


#: The kinds of :class:`Change`, in the order :func:`pending_change` looks for them.
SUPERSEDED = "superseded"  # a later round was completed without this node
LOST = "lost"  # a member's lease ended, its liveness connection dropped, or it came back anew
LEAVING = "leaving"  # a member announced a planned leave
WAITING = "waiting"  # a newcomer, or a member whose workers failed and that re-joined
CHANGE_KINDS = (SUPERSEDED, LOST, LEAVING, WAITING)


@dataclass(frozen=True)
class Change:
    """Why the current round is obsolete."""

    kind: str  # one of CHANGE_KINDS
    nodes: frozenset[str]


def order_members(
    joined: dict[str, Member], previous: RoundRecord | None, max_nodes: int
) -> tuple[Member, ...]:
    """Rank order for a new round: the previous round's members keep their order
    (rank 0 stays where it was while it lives), newcomers follow by node id;
    at most ``max_nodes``."""
    before = [n for n in (previous.nodes() if previous else ()) if n in joined]
    after = sorted(n for n in joined if n not in before)
    return tuple(joined[n] for n in (before + after)[:max_nodes])


def behind(joins: Mapping[str, JoinRecord], dead: frozenset[str] | set[str], target: int) -> (
    list[JoinRecord]
):
    """The records that hold round ``target`` up unless their node is dead: an
    older wish, from a member still running the last round or one that died
    without a word (the handler asks their liveness ports). Dead incarnations
    and leaving nodes hold nothing up."""
    return [j for j in joins.values()
            if j.member.incarnation not in dead and not j.leaving and j.round < target]


def complete_round(
    node: str, target: int, *, joins: Mapping[str, JoinRecord],
    dead: frozenset[str] | set[str], expected: frozenset[str], previous: RoundRecord | None,
    min_nodes: int, max_nodes: int,
) -> tuple[Member, ...] | None:
    """The members of round ``target``, in rank order, if it is complete now; else None.

    It is complete once ``node`` itself has joined it (a view without its own
    record is older than its join, and would leave it out), at least
    ``min_nodes`` have, no living node is :func:`behind`, and every node in
    ``expected`` (assigned ones, while the handler waits for them) has a record.
    """
    joined = {n: j.member for n, j in joins.items()
              if j.member.incarnation not in dead and not j.leaving and j.round >= target}
    if node not in joined or len(joined) < min_nodes or behind(joins, dead, target):
        return None
    if expected - joins.keys():
        return None
    return order_members(joined, previous, max_nodes)


def leaving_members(node: str, mine: RoundRecord, joins: Mapping[str, JoinRecord]) -> (
    frozenset[str]
):
    """The other members of ``node``'s round whose record (that incarnation's) says leaving."""
    return frozenset(
        m.node for m in mine.members
        if m.node != node and (j := joins.get(m.node)) is not None
        and j.leaving and j.member.incarnation == m.incarnation
    )


def waiting_nodes(
    node: str, mine: RoundRecord | None, joins: Mapping[str, JoinRecord],
    dead: frozenset[str] | set[str], max_nodes: int,
) -> frozenset[str]:
    """Nodes that want a round after ``node``'s: members that re-joined, and
    newcomers while there is room for them (else a full round would restart
    for nothing). ``dead``: incarnations known dead, never waited for."""
    number = mine.round if mine else 0
    nodes = mine.nodes() if mine else ()
    room = mine is None or len(nodes) < max_nodes
    return frozenset(
        n for n, j in joins.items()
        if n != node and j.round > number and not j.leaving
        and j.member.incarnation not in dead
        and (room or n in nodes)
    )


def pending_change(
    node: str, mine: RoundRecord | None, latest: RoundRecord | None, *,
    joins: Mapping[str, JoinRecord], lost: frozenset[str] | set[str],
    dead: frozenset[str] | set[str], max_nodes: int,
) -> Change | None:
    """Why ``node``'s round ``mine`` is obsolete, or None while it holds (or it has none).

    Args:
        node: this node.
        mine: the round this node is in; None between rounds.
        latest: the last completed round this node has seen.
        joins: every node's join record.
        lost: members of ``mine`` lost since it formed.
        dead: incarnations known dead.
        max_nodes: the job's upper bound (a full round does not wait for newcomers).

    Returns:
        The first that applies, in the order of :data:`CHANGE_KINDS`.
    """
    if mine is None:
        return None
    if latest is not None and latest.round > mine.round:
        return Change(SUPERSEDED, frozenset())
    if lost:
        return Change(LOST, frozenset(lost))
    leaving = leaving_members(node, mine, joins)
    if leaving:
        return Change(LEAVING, leaving)
    waiting = waiting_nodes(node, mine, joins, dead, max_nodes)
    if waiting:
        return Change(WAITING, waiting)
    return None


def staying_peers(
    node: str, mine: RoundRecord | None, joins: Mapping[str, JoinRecord],
    lost: frozenset[str] | set[str],
) -> frozenset[str]:
    """The other members of ``node``'s round that neither left, nor were lost,
    nor announced a leave: those a planned leave of ``node`` can resize with."""
    if mine is None:
        return frozenset()
    return frozenset(
        m.node for m in mine.members
        if m.node != node and m.node not in lost
        and (j := joins.get(m.node)) is not None and not j.leaving
        and j.member.incarnation == m.incarnation
    )
