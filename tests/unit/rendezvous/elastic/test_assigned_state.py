"""The one-writer rounds' records and decisions (rendezvous.elastic.assigned_state), pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rendezvous.elastic.assigned_rounds import (
    LEAVING,
    LOST,
    SUPERSEDED,
    WAITING,
    Change,
    JoinRecord,
    Member,
    RoundRecord,
)
from rendezvous.elastic.assigned_state import (
    TXN_OPS,
    Peer,
    RankRecord,
    StateRecord,
    chunks,
    decide,
    deputy_of,
    holds_lost,
    member_change,
    next_roster,
    ring_of,
)


def member(node: str, inc: str = "i") -> Member:
    return Member(node, "127.0.0.1", 1000 + len(node), f"{node}-{inc}")


def join(node: str, round_: int, *, inc: str = "i", leaving: bool = False) -> JoinRecord:
    return JoinRecord(member(node, inc), round_, leaving=leaving)


def test_the_records_read_back_what_they_wrote() -> None:
    state = StateRecord(4, 3, why=Change(LOST, frozenset({"c"})), leader="a", deputy="b")
    assert StateRecord.from_json(state.to_json()) == state
    rank = RankRecord(4, 1, member("b"), (Peer(member("c"), 7), Peer(member("a"), 9)))
    assert RankRecord.from_json(rank.to_json()) == rank


def test_a_member_record_stays_small_at_sixteen_thousand_members() -> None:
    # etcd refuses a request over 1.5 MiB and a transaction over 128 operations.
    members = tuple(Member(f"node-{i:05d}-{'x' * 40}", "10.0.0.1", 65535, "0123456789ab")
                    for i in range(16_000))
    leases = {m.node: 2**62 for m in members}
    records = [RankRecord(9, i, m, ring_of(members, leases, i)).to_json()
               for i, m in enumerate(members[:100])]
    assert max(len(r) for r in records) < 1024
    assert TXN_OPS * 1024 < 1_500_000 and TXN_OPS <= 128
    state = StateRecord(9, 16_000, why=Change(LOST, frozenset({members[0].node})),
                        leader=members[1].node, deputy=members[2].node)
    assert len(state.to_json()) < 1024


def test_the_first_round_forms_once_min_nodes_and_every_assigned_node_joined() -> None:
    joins = {n: join(n, 1) for n in ("b", "a")}
    assert decide(None, joins, set(), frozenset(), min_nodes=3, max_nodes=8).members is None
    waiting = decide(None, joins, set(), frozenset({"a", "b", "x"}), min_nodes=1, max_nodes=8)
    assert waiting.members is None
    formed = decide(None, joins, set(), frozenset({"a", "b"}), min_nodes=2, max_nodes=8)
    assert formed.members is not None and [m.node for m in formed.members] == ["a", "b"]


def test_a_lost_member_forms_the_next_round_at_once_and_ranks_stay() -> None:
    current = RoundRecord(3, (member("c"), member("a"), member("b")))
    joins = {n: join(n, 3) for n in ("a", "b", "c")}
    assert decide(current, joins, set(), frozenset(), min_nodes=1, max_nodes=8).members is None
    dead = decide(current, joins, {"a-i"}, frozenset(), min_nodes=1, max_nodes=8)
    assert dead.change == Change(LOST, frozenset({"a"}))
    assert dead.members is not None and [m.node for m in dead.members] == ["c", "b"]
    del joins["b"]
    gone = decide(current, joins, set(), frozenset(), min_nodes=3, max_nodes=8)
    assert gone == gone.__class__(None, Change(LOST, frozenset({"b"})))  # below min: pending


def test_leaving_and_waiting_and_a_full_round() -> None:
    current = RoundRecord(2, (member("a"), member("b")))
    joins = {"a": join("a", 2), "b": join("b", 2, leaving=True)}
    leave = decide(current, joins, set(), frozenset(), min_nodes=1, max_nodes=2)
    assert leave.change == Change(LEAVING, frozenset({"b"}))
    assert leave.members is not None and [m.node for m in leave.members] == ["a"]
    joins = {"a": join("a", 2), "b": join("b", 2), "c": join("c", 3)}
    assert decide(current, joins, set(), frozenset(), min_nodes=1, max_nodes=2).change is None
    grow = decide(current, joins, set(), frozenset(), min_nodes=1, max_nodes=3)
    assert grow.change == Change(WAITING, frozenset({"c"}))
    joins["b"] = join("b", 3)  # its workers failed: it asks for a later round
    assert decide(current, joins, set(), frozenset(), min_nodes=1,
                  max_nodes=2).change == Change(WAITING, frozenset({"b"}))


def test_a_new_incarnation_is_a_loss_of_the_old_one() -> None:
    current = RoundRecord(2, (member("a"), member("b")))
    joins = {"a": join("a", 2), "b": join("b", 3, inc="new")}
    decision = decide(current, joins, set(), frozenset(), min_nodes=1, max_nodes=8)
    assert decision.change == Change(LOST, frozenset({"b"}))
    assert decision.members is not None
    assert [m.incarnation for m in decision.members] == ["a-i", "b-new"]


def test_what_a_member_reads_from_the_state() -> None:
    assert member_change("a", 0, StateRecord(5, 3), True, set()) is None
    why = Change(LOST, frozenset({"c"}))
    assert member_change("a", 4, StateRecord(5, 2, why=why), True, set()) == why
    assert member_change("a", 4, StateRecord(5, 2, why=why), False, set()) == Change(
        SUPERSEDED, frozenset())
    assert member_change("a", 5, StateRecord(5, 2, why=why), True, set()) is None
    assert member_change("a", 5, StateRecord(5, 2), True, {"b"}) == Change(LOST, frozenset({"b"}))
    pending = StateRecord(5, 2, pending=Change(LEAVING, frozenset({"a"})))
    assert member_change("a", 5, pending, True, set()) is None  # its own leave
    assert member_change("b", 5, pending, True, set()) == Change(LEAVING, frozenset({"a"}))


def test_a_loss_this_member_saw_comes_before_a_newer_round_formed_for_a_leave() -> None:
    """c died and b was drained at the same moment; the leader formed round 5 for b's
    leave before it knew of c. a saw c die: its group is broken, a loss, not a leave."""
    leave = StateRecord(5, 2, why=Change(LEAVING, frozenset({"b"})))
    assert member_change("a", 4, leave, True, {"c"}) == Change(LOST, frozenset({"c"}))
    assert member_change("a", 4, leave, True, set()) == Change(LEAVING, frozenset({"b"}))
    # Left out of the newer round: the others went on without it, whatever it saw.
    assert member_change("a", 4, leave, False, {"c"}) == Change(SUPERSEDED, frozenset())


def test_a_round_that_still_holds_a_peer_seen_dead_is_not_joined() -> None:
    formed_before_the_loss = RankRecord(5, 0, member("a"), (Peer(member("c"), 7),))
    formed_after = RankRecord(6, 0, member("a"), ())
    assert holds_lost(formed_before_the_loss, {"c"}) == {"c"}
    assert holds_lost(formed_before_the_loss, {"b"}) == frozenset()
    assert holds_lost(formed_after, {"c"}) == frozenset()


@given(st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=5))
def test_the_ring_watches_k_others_and_every_member_is_watched(n: int, k: int) -> None:
    members = tuple(member(f"n{i}") for i in range(n))
    rings = [ring_of(members, {}, i, k) for i in range(n)]
    for i, ring in enumerate(rings):
        assert len(ring) == min(k, n - 1)
        assert members[i] not in [p.member for p in ring]
    watched = {p.member.node for ring in rings for p in ring}
    assert watched == ({m.node for m in members} if n > 1 else set())


@given(st.lists(st.sampled_from("abcdefgh"), unique=True, min_size=1),
       st.lists(st.sampled_from("abcdefghijk"), unique=True), st.integers(1, 12))
def test_a_formed_round_keeps_the_survivors_order_within_bounds(
    previous: list[str], joined: list[str], max_nodes: int
) -> None:
    current = RoundRecord(1, tuple(member(n) for n in previous))
    joins = {n: join(n, 1) for n in joined}
    decision = decide(current, joins, set(), frozenset(), min_nodes=1, max_nodes=max_nodes)
    if decision.members is None:
        return
    nodes = [m.node for m in decision.members]
    assert len(nodes) <= max_nodes and set(nodes) <= set(joined)
    survivors = [n for n in previous if n in joined]
    assert nodes[:len(survivors)] == survivors[:len(nodes)]
    assert deputy_of(decision.members, nodes[0]) == (nodes[1] if len(nodes) > 1 else "")


@given(st.integers(min_value=0, max_value=1000))
def test_chunks_cover_every_op_within_the_cap(n: int) -> None:
    parts = chunks(list(range(n)))
    assert [x for part in parts for x in part] == list(range(n))
    assert all(0 < len(part) <= TXN_OPS for part in parts)


def test_the_next_roster_follows_from_the_last_and_the_change_or_is_read() -> None:
    roster = frozenset({"a", "b", "c"})
    lost = StateRecord(5, 2, why=Change(LOST, frozenset({"c"})))
    assert next_roster(roster, 4, lost) == {"a", "b"}
    assert next_roster(roster, 4, StateRecord(5, 4, why=Change(WAITING, frozenset({"d"})))) == {
        "a", "b", "c", "d"}
    # a loss and a newcomer at once: the state says "lost" only, the size tells
    assert next_roster(roster, 4, StateRecord(5, 3, why=Change(LOST, frozenset({"c"})))) is None
    assert next_roster(roster, 3, lost) is None  # a round skipped
    assert next_roster(frozenset(), 4, lost) is None  # the first: read
