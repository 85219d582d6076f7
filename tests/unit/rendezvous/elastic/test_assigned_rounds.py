"""The assigned rendezvous's records and its decisions about rounds, without etcd or torch."""

from __future__ import annotations

import pytest
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
    behind,
    complete_round,
    order_members,
    pending_change,
    staying_peers,
    waiting_nodes,
)
from rendezvous.keys import InvalidIdentifierError


def member(node: str, incarnation: str = "") -> Member:
    return Member(node=node, addr="127.0.0.1", port=1, incarnation=incarnation or node)


def join(node: str, round_: int, *, leaving: bool = False, incarnation: str = "") -> JoinRecord:
    return JoinRecord(member(node, incarnation), round_, leaving=leaving)


def joins(*records: JoinRecord) -> dict[str, JoinRecord]:
    return {r.member.node: r for r in records}


ROUND = RoundRecord(2, (member("a"), member("b"), member("c")))


def test_the_records_read_back_what_they_wrote_and_refuse_an_unsafe_node_id() -> None:
    assert RoundRecord.from_json(ROUND.to_json()) == ROUND
    record = join("b", 3, leaving=True)
    assert JoinRecord.from_json(record.to_json()) == record
    assert b"leaving" not in join("b", 3).to_json()  # an older reader sees what it knows
    with pytest.raises(InvalidIdentifierError):
        JoinRecord.from_json(join("../x", 1).to_json())


def change(view: dict[str, JoinRecord], *, latest: RoundRecord | None = ROUND,
           lost: frozenset[str] = frozenset(), dead: frozenset[str] = frozenset(),
           max_nodes: int = 8) -> Change | None:
    return pending_change("a", ROUND, latest, joins=view, lost=lost, dead=dead,
                          max_nodes=max_nodes)


def test_a_round_holds_while_every_member_is_in_it_and_nobody_waits() -> None:
    assert change(joins(join("a", 2), join("b", 2), join("c", 1))) is None
    assert pending_change("a", None, ROUND, joins={}, lost={"b"}, dead=set(), max_nodes=8) is None


def test_a_round_is_obsolete_for_the_first_reason_in_order() -> None:
    view = joins(join("a", 2), join("b", 2, leaving=True), join("c", 2), join("d", 3))
    later = RoundRecord(3, (member("b"), member("c")))
    assert change(view, latest=later, lost=frozenset({"c"})) == Change(SUPERSEDED, frozenset())
    assert change(view, lost=frozenset({"c"})) == Change(LOST, frozenset({"c"}))
    assert change(view) == Change(LEAVING, frozenset({"b"}))
    assert change({**view, "b": join("b", 2)}) == Change(WAITING, frozenset({"d"}))


def test_a_leave_counts_only_from_the_incarnation_in_the_round() -> None:
    view = joins(join("a", 2), join("b", 2, leaving=True, incarnation="new"), join("c", 2))
    assert change(view) is None


def test_a_full_round_waits_for_members_that_rejoined_but_not_for_newcomers() -> None:
    view = joins(join("a", 2), join("b", 3), join("c", 2), join("d", 3))
    assert waiting_nodes("a", ROUND, view, set(), max_nodes=3) == {"b"}
    assert waiting_nodes("a", ROUND, view, set(), max_nodes=4) == {"b", "d"}
    assert waiting_nodes("a", ROUND, view, {"d"}, max_nodes=4) == {"b"}  # a dead incarnation
    leaving = {**view, "d": join("d", 3, leaving=True)}
    assert waiting_nodes("a", ROUND, leaving, set(), max_nodes=4) == {"b"}


def test_a_leaving_node_resizes_with_the_members_that_stay() -> None:
    view = joins(join("a", 2), join("b", 2, leaving=True), join("c", 2))
    assert staying_peers("a", ROUND, view, set()) == {"c"}
    assert staying_peers("a", ROUND, view, {"c"}) == frozenset()
    assert staying_peers("a", ROUND, {**view, "c": join("c", 2, incarnation="x")},
                         set()) == frozenset()
    assert staying_peers("a", None, view, set()) == frozenset()


def complete(view: dict[str, JoinRecord], *, dead: frozenset[str] = frozenset(),
             expected: frozenset[str] = frozenset(), min_nodes: int = 1,
             max_nodes: int = 8) -> list[str] | None:
    members = complete_round("a", 3, joins=view, dead=dead, expected=expected,
                             previous=ROUND, min_nodes=min_nodes, max_nodes=max_nodes)
    return None if members is None else [m.node for m in members]


def test_a_round_completes_once_nobody_living_or_expected_is_behind() -> None:
    view = joins(join("a", 3), join("c", 3), join("b", 2), join("e", 3))
    assert [j.member.node for j in behind(view, set(), 3)] == ["b"]
    assert complete(view) is None  # b still runs round 2: ask it, or wait
    assert complete(view, dead=frozenset({"b"})) == ["a", "c", "e"]  # the old order first
    assert complete(view, dead=frozenset({"b"}), expected=frozenset({"f"})) is None
    assert complete(view, dead=frozenset({"b"}), min_nodes=4) is None
    assert complete(view, dead=frozenset({"b"}), max_nodes=2) == ["a", "c"]
    assert complete({**view, "b": join("b", 2, leaving=True)}) == ["a", "c", "e"]
    assert complete(joins(join("c", 3))) is None  # without this node's own record


nodes = st.sampled_from("abcdef")


@given(st.dictionaries(nodes, st.tuples(st.integers(1, 4), st.booleans()), max_size=6),
       st.sets(nodes), st.integers(1, 3), st.integers(3, 6))
def test_a_completed_round_holds_only_living_joined_nodes_within_the_bounds(
    wishes: dict[str, tuple[int, bool]], dead: set[str], min_nodes: int, max_nodes: int
) -> None:
    view = {n: join(n, r, leaving=gone) for n, (r, gone) in wishes.items()}
    members = complete_round("a", 3, joins=view, dead=dead, expected=frozenset(),
                             previous=ROUND, min_nodes=min_nodes, max_nodes=max_nodes)
    if members is None:
        return
    names = [m.node for m in members]
    assert min(min_nodes, max_nodes) <= len(names) <= max_nodes
    assert len(set(names)) == len(names)
    for name in names:
        assert name not in dead and not view[name].leaving and view[name].round >= 3
    old = [n for n in ROUND.nodes() if n in names]
    assert names[:len(old)] == old  # the previous members keep their ranks' order


def test_members_keep_their_ranks_and_newcomers_follow_in_name_order() -> None:
    previous = RoundRecord(1, (member("c"), member("a"), member("b")))
    joined = {n: member(n) for n in ("a", "b", "d", "e")}
    assert [m.node for m in order_members(joined, previous, 10)] == ["a", "b", "d", "e"]
    joined["c"] = member("c")
    assert [m.node for m in order_members(joined, previous, 4)] == ["c", "a", "b", "d"]
    assert [m.node for m in order_members(joined, None, 2)] == ["a", "b"]
