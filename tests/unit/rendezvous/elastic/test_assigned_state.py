"""The one-writer rounds' records and decisions (rendezvous.elastic.assigned_state), pure."""

from __future__ import annotations

from dataclasses import replace

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
    ROSTER_CHUNK,
    TXN_OPS,
    Peer,
    RankRecord,
    Roster,
    StateRecord,
    chunks,
    decide,
    deputy_of,
    derive_rank,
    gone_ranks,
    holds_lost,
    member_change,
    next_roster,
    rereads,
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


def test_a_state_that_lets_members_derive_reads_back_and_stays_compact() -> None:
    state = StateRecord(5, 3, why=Change(LOST, frozenset({"d"})), leader="a", deputy="b",
                        derive=True, gone=(3,), reread=frozenset({"b", "c"}))
    assert StateRecord.from_json(state.to_json()) == state
    plain = StateRecord(5, 3)
    assert StateRecord.from_json(plain.to_json()) == plain
    assert b" " not in plain.to_json() and b"pending" not in plain.to_json()


def write_round(previous: tuple[Member, ...], members: tuple[Member, ...], round_: int,
                why: Change | None) -> tuple[dict[str, RankRecord], StateRecord]:
    """What the leader writes: the rank records and a state naming who must read."""
    leases = {m.node: 7 for m in (*previous, *members)}
    old = {m.node: RankRecord(round_ - 1, i, m, ring_of(previous, leases, i))
           for i, m in enumerate(previous)}
    new = {m.node: RankRecord(round_, i, m, ring_of(members, leases, i))
           for i, m in enumerate(members)}
    state = StateRecord(round_, len(members), why=why, derive=True,
                        gone=gone_ranks(previous, members))
    state = replace(state, reread=rereads(tuple(old.values()), new, state))
    return old, state


@given(st.integers(2, 40), st.data())
def test_every_member_derives_the_record_the_leader_wrote_or_is_told_to_read(
    n: int, data: st.DataObject,
) -> None:
    previous = tuple(member(f"n{i:02d}") for i in range(n))
    lost = data.draw(st.sets(st.sampled_from([m.node for m in previous]), max_size=n - 1))
    newcomers = tuple(member(f"z{i}") for i in range(data.draw(st.integers(0, 3))))
    kind = LOST if lost else WAITING
    members = tuple(m for m in previous if m.node not in lost) + newcomers
    why = Change(kind, frozenset(lost) if lost else frozenset(m.node for m in newcomers))
    leases = {m.node: 7 for m in (*previous, *members)}
    new = {m.node: RankRecord(9, i, m, ring_of(members, leases, i)) for i, m in enumerate(members)}
    old, state = write_round(previous, members, 9, why)
    for node, record in old.items():
        ok, derived = derive_rank(record, state)
        if ok:
            assert derived == new.get(node)
        else:
            assert node in state.reread
    # a ring changes only around a change: the rereads do not grow with n
    assert len(state.reread) <= 2 * (len(lost) + 1) + 2


def test_a_kill_makes_only_the_dead_members_ring_predecessors_read() -> None:
    previous = tuple(member(f"n{i}") for i in range(8))
    members = previous[:5] + previous[6:]  # n5 died
    _, state = write_round(previous, members, 3, Change(LOST, frozenset({"n5"})))
    assert state.gone == (5,) and state.reread == {"n3", "n4"}
    old = RankRecord(2, 7, previous[7], ())
    assert derive_rank(old, state) == (True, RankRecord(3, 6, previous[7], ()))
    dead = RankRecord(2, 5, previous[5], ())
    assert derive_rank(dead, state) == (True, None)  # superseded, whatever it believes
    assert derive_rank(RankRecord(1, 7, previous[7], ()), state) == (False, None)  # a gap
    assert derive_rank(old, StateRecord(3, 7)) == (False, None)  # the leader did not say


def test_the_roster_reads_back_in_chunks_with_the_leaders_view() -> None:
    members = tuple(member(f"n{i:05d}") for i in range(ROSTER_CHUNK + 5))
    leases = {m.node: i for i, m in enumerate(members)}
    outside = ((join("w", 3), 11, False), (join("x", 2, inc="old"), 12, True))
    roster = Roster(4, members, leases, 99, outside)
    values = roster.chunks()
    assert len(values) == 2
    assert Roster.parse(values, 4, len(members)) == roster
    assert Roster.parse(values, 5, len(members)) is None  # another round's
    assert Roster.parse(values[1:], 4, len(members)) is None  # a gap
    assert Roster.parse(values, 4, len(members) + 1) is None


def test_the_roster_stays_small_at_sixteen_thousand_members() -> None:
    members = tuple(Member(f"node-{i:05d}-{'x' * 40}", "10.0.0.1", 65535, "0123456789ab")
                    for i in range(16_000))
    values = Roster(9, members, {m.node: 2**62 for m in members}, 2**40).chunks()
    assert len(values) == -(-16_000 // ROSTER_CHUNK)
    assert max(len(v) for v in values) < 150_000


def test_a_peer_back_under_a_new_lease_makes_nobody_read() -> None:
    # (the 1,024 soak: ~900 join records put back under new leases named every member)
    members = tuple(member(f"n{i}") for i in range(6))
    old = tuple(RankRecord(2, i, m, ring_of(members, {}, i)) for i, m in enumerate(members))
    new = {m.node: RankRecord(3, i, m, ring_of(members, {m.node: 99 for m in members}, i))
           for i, m in enumerate(members)}
    state = StateRecord(3, 6, why=Change(WAITING, frozenset()), derive=True)
    assert rereads(old, new, state) == frozenset()
