"""The one-writer rounds of the assigned rendezvous: their small records and pure decisions.

One member, the *leader*, reads every join record and writes each round once
(:mod:`rendezvous.elastic.assigned_leader`); the others read two small records
(:mod:`rendezvous.elastic.assigned`):

* :class:`StateRecord` (``ctl/state``, every member watches it): the last round's number
  and size, why it was formed or why the current one is obsolete (a pending
  :class:`~rendezvous.elastic.assigned_rounds.Change` that cannot form a round yet), who
  leads and who takes over (the *deputy*);
* :class:`RankRecord` (``rank/<node>``, read by that node only, once per round): its
  rank, and the k ring peers whose liveness port it watches (with their leases).

What the leader decides from the join records (:func:`decide`), what a member
concludes from the state (:func:`member_change`) and the ring (:func:`ring_of`) are
pure functions here; neither torch nor etcd is imported.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.elastic.assigned_rounds import (
    LEAVING,
    LOST,
    SUPERSEDED,
    WAITING,
    Change,
    JoinRecord,
    Member,
    RoundRecord,
    order_members,
)

#: Liveness ring: each member watches this many successors in rank order.
RING_K = 2
#: At most this many operations in one of the leader's transactions (etcd's cap: 128).
TXN_OPS = 64


def _change_to(change: Change | None) -> object:
    return None if change is None else {"kind": change.kind, "nodes": sorted(change.nodes)}


def _change_from(raw: object) -> Change | None:
    if not isinstance(raw, dict):
        return None
    return Change(str(raw["kind"]), frozenset(str(n) for n in raw["nodes"]))


@dataclass(frozen=True)
class StateRecord:
    """``ctl/state``: the last round, and why the rounds moved.

    ``why``: the change the round ``round`` was formed for (None: the first);
    ``pending``: a change of round ``round`` that cannot form the next one yet
    (fewer than min_nodes, or assigned nodes not come). ``leader``/``deputy``:
    who writes rounds, and who takes over at once when it is lost.

    ``derive``: a member of round ``round - 1`` may derive its rank record in this
    round from its own previous one (:func:`derive_rank`) instead of reading it, unless
    it is named in ``reread`` (its ring changed, or it would derive wrongly); ``gone``:
    the ranks in round ``round - 1`` of its members not in this round, which the others'
    ranks close up over. False: everyone reads (the leader did not know the last
    round's rings).
    """

    round: int
    world: int
    why: Change | None = None
    pending: Change | None = None
    leader: str = ""
    deputy: str = ""
    derive: bool = False
    gone: tuple[int, ...] = ()
    reread: frozenset[str] = frozenset()

    def to_json(self) -> bytes:
        # Every member receives this on each change: compact, no empty fields.
        data: dict[str, object] = {"round": self.round, "world": self.world}
        if self.why is not None:
            data["why"] = _change_to(self.why)
        if self.pending is not None:
            data["pending"] = _change_to(self.pending)
        if self.leader:
            data["leader"] = self.leader
        if self.deputy:
            data["deputy"] = self.deputy
        if self.derive:
            data["derive"] = {"gone": list(self.gone), "reread": sorted(self.reread)}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StateRecord:
        raw = json.loads(data)
        derive = raw.get("derive")
        gone: tuple[int, ...] = ()
        reread: frozenset[str] = frozenset()
        if isinstance(derive, dict):
            gone = tuple(int(g) for g in derive["gone"])
            reread = frozenset(str(n) for n in derive["reread"])
        return cls(int(raw["round"]), int(raw["world"]), _change_from(raw.get("why")),
                   _change_from(raw.get("pending")), str(raw.get("leader", "")),
                   str(raw.get("deputy", "")), isinstance(derive, dict), gone, reread)


@dataclass(frozen=True)
class Peer:
    """A ring peer: where its liveness port is, and the lease of its join record."""

    member: Member
    lease: int


@dataclass(frozen=True)
class RankRecord:
    """``rank/<node>``: the node's place in round ``round``."""

    round: int
    rank: int
    member: Member
    ring: tuple[Peer, ...]

    def to_json(self) -> bytes:
        return json.dumps({
            "round": self.round, "rank": self.rank, **self.member.to_dict(),
            "ring": [{**p.member.to_dict(), "lease": p.lease} for p in self.ring],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RankRecord:
        raw = json.loads(data)
        ring = tuple(Peer(Member.from_dict(p), int(p["lease"])) for p in raw["ring"])
        return cls(int(raw["round"]), int(raw["rank"]), Member.from_dict(raw), ring)


#: Members per roster chunk (``roster/<chunk>``: ~60 bytes a member, so ~60 KB a key).
ROSTER_CHUNK = 1024


@dataclass(frozen=True)
class Roster:
    """What a leader taking over starts from: the last round's members in rank order with
    their join records' leases, and the rest of the leader's view when it formed that
    round: ``seen``, the last revision of ``m/`` it had applied (0: unknown), and
    ``outside``, the join records of nodes not in the round (waiting, leaving, or of a
    dead incarnation: ``(record, lease, dead)``). With it, the successor watches ``m/``
    from ``seen + 1`` instead of reading every join record (and every rank record)."""

    round: int
    members: tuple[Member, ...]
    leases: Mapping[str, int]
    seen: int = 0
    outside: tuple[tuple[JoinRecord, int, bool], ...] = ()

    def chunks(self) -> list[bytes]:
        """The values of its chunks (``roster/<i>``), at most :data:`ROSTER_CHUNK`
        members each; the first also carries ``seen`` and ``outside``."""
        values = []
        for first in range(0, max(len(self.members), 1), ROSTER_CHUNK):
            data: dict[str, object] = {"round": self.round, "first": first, "members": [
                [m.node, m.incarnation, m.addr, m.port, self.leases.get(m.node, 0)]
                for m in self.members[first:first + ROSTER_CHUNK]
            ]}
            if first == 0:
                data["seen"] = self.seen
                data["outside"] = [[json.loads(j.to_json()), lease, dead]
                                   for j, lease, dead in self.outside]
            values.append(json.dumps(data, separators=(",", ":")).encode())
        return values

    @classmethod
    def parse(cls, values: list[bytes], round_: int, world: int) -> Roster | None:
        """Round ``round_``'s roster from its chunks' values (in key order; chunks of
        other rounds are skipped); None unless they add up to ``world`` members."""
        members: list[Member] = []
        leases: dict[str, int] = {}
        seen = 0
        outside: tuple[tuple[JoinRecord, int, bool], ...] = ()
        try:
            for value in values:
                raw = json.loads(value)
                if int(raw["round"]) != round_:
                    continue
                if int(raw["first"]) != len(members):
                    return None
                if "seen" in raw:
                    seen = int(raw["seen"])
                    outside = tuple((JoinRecord.from_json(json.dumps(j).encode()), int(lease),
                                     dead is True) for j, lease, dead in raw["outside"])
                for node, incarnation, addr, port, lease in raw["members"]:
                    members.append(Member.from_dict({"node": node, "incarnation": incarnation,
                                                     "addr": addr, "port": port}))
                    leases[str(node)] = int(lease)
        except (ValueError, KeyError, TypeError):
            return None
        if len(members) != world:
            return None
        return cls(round_, tuple(members), leases, seen, outside)


def ring_of(members: tuple[Member, ...], leases: Mapping[str, int], index: int,
            k: int = RING_K) -> tuple[Peer, ...]:
    """The (at most ``k``) successors of ``members[index]``, cyclic, itself excluded."""
    n = len(members)
    return tuple(Peer(members[(index + i) % n], leases.get(members[(index + i) % n].node, 0))
                 for i in range(1, min(k, n - 1) + 1))


def deputy_of(members: tuple[Member, ...], leader: str) -> str:
    """Who takes over from ``leader``: the member after it in rank order."""
    nodes = [m.node for m in members]
    if not nodes:
        return ""
    if leader not in nodes:
        return nodes[0]
    return nodes[(nodes.index(leader) + 1) % len(nodes)] if len(nodes) > 1 else ""


def round_change(current: RoundRecord, joins: Mapping[str, JoinRecord],
                 dead: frozenset[str] | set[str], max_nodes: int) -> Change | None:
    """Why round ``current`` is obsolete, as the leader sees the join records; None
    while it holds. In order: a member lost (record gone, another incarnation, or a
    ring peer's word that it died), a member leaving, a node waiting (a newcomer
    while there is room, or a member that asked for a later round)."""
    lost = frozenset(
        m.node for m in current.members
        if (j := joins.get(m.node)) is None or j.member.incarnation != m.incarnation
        or m.incarnation in dead
    )
    if lost:
        return Change(LOST, lost)
    leaving = frozenset(m.node for m in current.members if joins[m.node].leaving)
    if leaving:
        return Change(LEAVING, leaving)
    nodes = set(current.nodes())
    room = len(nodes) < max_nodes
    waiting = frozenset(
        n for n, j in joins.items()
        if not j.leaving and j.member.incarnation not in dead
        and ((n in nodes and j.round > current.round) or (n not in nodes and room))
    )
    return Change(WAITING, waiting) if waiting else None


@dataclass(frozen=True)
class Decision:
    """The leader's decision: the next round's members (None: no round now), and the
    change that makes the current one obsolete (None: it holds)."""

    members: tuple[Member, ...] | None
    change: Change | None


def decide(current: RoundRecord | None, joins: Mapping[str, JoinRecord],
           dead: frozenset[str] | set[str], expected: frozenset[str], *,
           min_nodes: int, max_nodes: int) -> Decision:
    """What the leader does with the join records it sees.

    A round is formed when there is none yet or the current one is obsolete
    (:func:`round_change`), at least ``min_nodes`` living, not leaving nodes have
    joined, and every node in ``expected`` (assigned ones, while the leader waits
    for them) has a record. Its members keep their ranks (:func:`order_members`).
    Nobody is waited for to acknowledge: a living member of the old round is in the
    new one, and learns it from the state record.
    """
    change = None if current is None else round_change(current, joins, dead, max_nodes)
    if current is not None and change is None:
        return Decision(None, None)
    joined = {n: j.member for n, j in joins.items()
              if not j.leaving and j.member.incarnation not in dead}
    if len(joined) < min_nodes or expected - joins.keys():
        return Decision(None, change)
    return Decision(order_members(joined, current, max_nodes), change)


def member_change(node: str, mine: int, state: StateRecord | None, in_latest: bool,
                  lost: frozenset[str] | set[str]) -> Change | None:
    """Why this node's round ``mine`` is obsolete, from what it reads; None while it holds.

    Args:
        node: this node.
        mine: the number of this node's round (0: none yet).
        state: the last state record seen.
        in_latest: whether this node is in the state's round (its rank record says so).
        lost: ring peers this node saw die since its round formed. A loss comes first
            even when a newer round was formed for another change (a leave or a join
            at the same moment, before the leader knew of the death): this node's group
            is broken and must be recovered as from a loss, not resized as planned.
    """
    if mine == 0:
        return None
    if state is not None and state.round > mine:
        if not in_latest:
            return Change(SUPERSEDED, frozenset())
        if lost:  # our group is broken, whatever the leader formed the next round for
            return Change(LOST, frozenset(lost))
        why = state.why or Change(WAITING, frozenset())
        return Change(why.kind, why.nodes - {node})
    if lost:
        return Change(LOST, frozenset(lost))
    if state is not None and state.round == mine and state.pending is not None:
        nodes = state.pending.nodes - {node}
        if nodes or state.pending.kind != LEAVING:
            return Change(state.pending.kind, nodes)
    return None


def derive_rank(previous: RankRecord, state: StateRecord) -> tuple[bool, RankRecord | None]:
    """A member's rank record in ``state``'s round, from its record in the round before.

    Returns:
        ``(True, record)``: derived (``record`` None: the member is not in the round);
        ``(False, None)``: not derivable, the member reads its rank record.

    Derivable when ``state`` is the next round, the leader says so (``derive``) and does
    not name the member in ``reread``. A member that the change names as lost or leaving
    is not in the round; any other keeps its ring and its place, closed up over the
    ``gone`` ranks (:func:`order_members` keeps the old order and appends newcomers).
    The leader checks every member's derivation against what it wrote (:func:`rereads`),
    so a derived record is the one a read would give.
    """
    node = previous.member.node
    if not state.derive or state.round != previous.round + 1 or node in state.reread:
        return False, None
    why = state.why
    if why is not None and why.kind in (LOST, LEAVING) and node in why.nodes:
        return True, None
    rank = previous.rank - sum(1 for g in state.gone if g < previous.rank)
    return True, RankRecord(state.round, rank, previous.member, previous.ring)


def rereads(previous: tuple[RankRecord, ...], current: Mapping[str, RankRecord],
            state: StateRecord) -> frozenset[str]:
    """The members of the last round (``previous``, their rank records) that would
    derive a wrong record for ``state``'s round (``current``: the new rank records by
    node; ``state`` without ``reread``): those whose ring changed (its peers' leases
    aside: a derived ring keeps the old ones, which nothing reads), a node back under
    another incarnation, a member cut by a lower ``max_nodes``. The leader names them
    in ``reread``; they read their records, the others derive them."""
    def seat(record: RankRecord | None) -> object:
        # A peer's lease is not part of it: nothing acts on it, and a member whose join
        # record was put back under a new lease (an etcd outage, a slow keep-alive) must
        # not make its ring predecessors read (the 1,024 soak: ~900 leases lost, every
        # member named, an 8 KB state to each).
        if record is None:
            return None
        return (record.round, record.rank, record.member, tuple(p.member for p in record.ring))

    wrong = set()
    for record in previous:
        node = record.member.node
        ok, derived = derive_rank(record, state)
        if not ok or seat(derived) != seat(current.get(node)):
            wrong.add(node)
    return frozenset(wrong)


def gone_ranks(previous: tuple[Member, ...], members: tuple[Member, ...]) -> tuple[int, ...]:
    """The ranks in the last round of its members that are not in the new one."""
    staying = {m.node for m in members}
    return tuple(i for i, m in enumerate(previous) if m.node not in staying)


def holds_lost(rank: RankRecord, lost: frozenset[str] | set[str]) -> frozenset[str]:
    """The peers this node saw die that are still in the ring of its ``rank`` record: a
    round the leader formed before it learnt of their death (a planned change at the same
    moment). Joining it would mean a group with a dead member; the next round drops them."""
    return frozenset(lost) & {p.member.node for p in rank.ring}


def next_roster(roster: frozenset[str], number: int, state: StateRecord | None) -> (
    frozenset[str] | None
):
    """The members of ``state``'s round, from those of round ``number`` and the change it
    was formed for, when that adds up (the next round, its size matches); else None.

    The state names only the first kind of change (a loss and a newcomer at once say
    "lost"): the size then differs, and the caller reads the rank records instead.
    """
    if state is None or state.why is None or number != state.round - 1 or not roster:
        return None
    why = state.why
    derived = roster | why.nodes if why.kind == WAITING else roster - why.nodes
    return derived if len(derived) == state.world else None


def chunks(items: list[object], size: int = TXN_OPS) -> list[list[object]]:
    """``items`` in runs of at most ``size`` (the leader's transactions)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
