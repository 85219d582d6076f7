"""The assigned-membership rendezvous against a real etcd, members in threads and processes."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from rendezvous.elastic.assigned import AssignedRendezvousHandler, AssignmentWithdrawnError
from rendezvous.elastic.assigned_rounds import Fence
from rendezvous.etcd import EtcdClient, EtcdConfig, Put, create_client
from rendezvous.keys import Keys
from rendezvous.records import Assignment
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

JOB = "job"
Make = Callable[..., AssignedRendezvousHandler]


@pytest.fixture
def make(etcd_config: EtcdConfig) -> Iterator[Make]:
    made: list[tuple[AssignedRendezvousHandler, EtcdClient]] = []

    def factory(
        node: str,
        *,
        min_nodes: int = 1,
        max_nodes: int = 3,
        expected: set[str] | None = None,
        **kwargs: Any,
    ) -> AssignedRendezvousHandler:
        client = create_client(etcd_config)
        handler = AssignedRendezvousHandler(
            client, run_id=JOB, node_id=node, addr="127.0.0.1", min_nodes=min_nodes,
            max_nodes=max_nodes, root=etcd_config.root,
            expected_nodes=None if expected is None else (lambda: expected),
            lease_ttl_s=int(kwargs.pop("lease_ttl_s", 2)), **kwargs,
        )
        made.append((handler, client))
        return handler

    yield factory
    for handler, client in made:
        handler.close()
        client.close()


def together(*handlers: AssignedRendezvousHandler) -> list[RendezvousInfo]:
    """Every handler's next round, joined concurrently."""
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=60))


def spawn_member(
    procs: ProcessGroupRegistry, config: EtcdConfig, node: str, log: Path, *, max_nodes: int = 3
) -> tuple[object, Callable[[], dict[str, object] | None]]:
    proc = procs.spawn(
        [sys.executable, "-m", "tests.support.rdzv_member", config.endpoints[0], config.root,
         JOB, node, "1", str(max_nodes)],
        log_path=log,
    )

    def joined() -> dict[str, object] | None:
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                return dict(json.loads(line))
        return None

    return proc, joined


def test_the_assigned_nodes_form_one_round_with_distinct_ranks(make: Make) -> None:
    nodes = {"a", "b", "c"}
    infos = together(*(make(n, expected=nodes) for n in sorted(nodes)))
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
               for i in infos if i.bootstrap_store_info}
    assert len(masters) == 1


def test_a_killed_member_is_noticed_at_once_and_nobody_waits_for_its_lease(
    make: Make, procs: ProcessGroupRegistry, etcd_config: EtcdConfig, etcd_client: EtcdClient,
    tmp_path: Path,
) -> None:
    # c holds a 2-s lease, but the round must not need it to expire: c's join
    # record is still in etcd when the survivors' next round completes, which
    # only the liveness port can explain.
    nodes = {"a", "b", "c"}
    a, b = make("a", expected=nodes), make("b", expected=nodes)
    proc, joined = spawn_member(procs, etcd_config, "c", tmp_path / "c.log")
    infos = together(a, b)
    assert {i.world_size for i in infos} == {3}
    wait_for(joined, timeout=30, what="c in the round")
    c_key = Keys(etcd_config.root).assigned_join(JOB, "c")
    assert etcd_client.get(c_key) is not None

    procs.signal_group(proc, signal.SIGKILL)  # type: ignore[arg-type]
    change = wait_for(a.pending_change, timeout=10, what="a to notice c's death")
    assert (change.kind, change.nodes) == ("lost", frozenset({"c"}))
    wait_for(b.pending_change, timeout=10, what="b to notice c's death")
    infos = together(a, b)
    assert [i.world_size for i in infos] == [2, 2]
    assert a.participants() == b.participants() == {"a", "b"}
    assert etcd_client.get(c_key) is not None, "the round waited for c's lease after all"


def test_each_member_reads_its_rank_record_once_a_round(
    make: Make, etcd_config: EtcdConfig, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The watch's thread, the round's waiter and the seat may each find the rank record
    # unread at once: at most one read per member and round (#24: each read is ~400 bytes
    # from etcd, for every member of every round), and none where the member derives it
    # from its last (its ring unchanged). Three rounds: a, b and c in all three, d in the
    # last two, e in the last. a (ring b, c all along) reads once; b's ring changes when d
    # comes (c, a -> c, d), c's twice (a, b -> d, a -> d, e), d's when e comes (a, b ->
    # e, a); a newcomer reads its own round only (the round it finds cannot hold it: it
    # had put no join record). (Before: 7, 7, 7, 6, 4; one read a round: 3, 3, 3, 3, 2.)
    reads: dict[str, int] = {}
    real_get = EtcdClient.get
    ranks = Keys(etcd_config.root).assigned_ranks_prefix(JOB)

    def counting_get(self: EtcdClient, key: str, **kwargs: Any) -> Any:
        if key.startswith(ranks):
            reads[key] = reads.get(key, 0) + 1
        return real_get(self, key, **kwargs)

    monkeypatch.setattr(EtcdClient, "get", counting_get)
    nodes = {"a", "b", "c"}
    handlers = [make(n, expected=nodes, max_nodes=5) for n in sorted(nodes)]
    assert {i.world_size for i in together(*handlers)} == {3}
    for newcomer in ("d", "e"):  # a round for each
        late = make(newcomer, max_nodes=5)
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(late.next_rendezvous)
            wait_for(lambda: all(h.pending_change() for h in handlers), timeout=10,
                     what=f"the members to see {newcomer} waiting")
            infos = [*together(*handlers), joining.result(timeout=30)]
        handlers.append(late)
        assert {i.world_size for i in infos} == {len(handlers)}
    key = Keys(etcd_config.root).assigned_rank
    assert [reads.get(key(JOB, n)) for n in "abcde"] == [1, 2, 3, 2, 1], reads


def test_a_newcomer_restarts_the_round_and_the_old_ranks_stay(make: Make) -> None:
    a, b = make("a", expected={"a", "b"}), make("b", expected={"a", "b"})
    before = {h: i.rank for h, i in zip((a, b), together(a, b), strict=True)}
    assert a.pending_change() is None and a.num_nodes_waiting() == 0
    c = make("c")
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(c.next_rendezvous)
        change = wait_for(a.pending_change, timeout=10, what="a to see c waiting")
        assert (change.kind, change.nodes) == ("waiting", frozenset({"c"}))
        assert a.num_nodes_waiting() == 1
        after = together(a, b)
        info_c = late.result(timeout=30)
    assert [i.world_size for i in (*after, info_c)] == [3, 3, 3]
    assert (after[0].rank, after[1].rank) == (before[a], before[b])
    assert info_c.rank == 2


def test_a_full_round_does_not_restart_for_a_newcomer(make: Make) -> None:
    a, b = (make(n, max_nodes=2, expected={"a", "b"}) for n in ("a", "b"))
    together(a, b)
    c = make("c", max_nodes=2, join_timeout_s=30)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(c.next_rendezvous)
        wait_for(lambda: c._join.wanted == 2, timeout=10, what="c to ask for the next round")
        leader = wait_for(lambda: next((h._leading for h in (a, b) if h._leading), None),
                          timeout=10, what="a round leader")
        wait_for(lambda: "c" in leader._joins, timeout=10, what="the leader to see c's record")
        decision = leader._decide()  # what the leader does with it: nothing
        assert (decision.members, decision.change) == (None, None)
        assert a.pending_change() is None
        assert a.num_nodes_waiting() == 0
        c.close()  # c's wait ends with the handler


def test_a_hung_member_is_dropped_once_its_lease_ends(
    make: Make, procs: ProcessGroupRegistry, etcd_config: EtcdConfig, tmp_path: Path
) -> None:
    nodes = {"a", "b", "c"}
    a, b = make("a", expected=nodes), make("b", expected=nodes)
    proc, joined = spawn_member(procs, etcd_config, "c", tmp_path / "c.log")
    together(a, b)
    wait_for(joined, timeout=30, what="c in the round")
    procs.signal_group(proc, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        # A stopped process's port still accepts connections: only its lease
        # (2 s) can tell. The liveness connections stay open.
        change = wait_for(a.pending_change, timeout=20, what="c's lease to end")
        assert (change.kind, change.nodes) == ("lost", frozenset({"c"}))
        nodes.discard("c")  # as the coordinator does once c's node lease ends too
        infos = together(a, b)
        assert [i.world_size for i in infos] == [2, 2]
    finally:
        procs.signal_group(proc, signal.SIGCONT)  # type: ignore[arg-type]


def test_an_assigned_node_that_never_comes_is_waited_for_only_so_long(make: Make) -> None:
    nodes = {"a", "b", "x"}
    infos = together(*(make(n, expected=nodes, assigned_wait_s=1.0) for n in ("a", "b")))
    assert [i.world_size for i in infos] == [2, 2]


def test_too_few_nodes_time_out_naming_min_nodes(make: Make) -> None:
    a = make("a", min_nodes=2, join_timeout_s=1.0)
    with pytest.raises(RendezvousTimeoutError, match="min_nodes=2"):
        a.next_rendezvous()


def test_shutdown_closes_the_rendezvous_for_every_node(make: Make) -> None:
    a, b = make("a", expected={"a", "b"}), make("b", expected={"a", "b"})
    together(a, b)
    assert a.shutdown()
    wait_for(b.is_closed, timeout=10, what="b to see the rendezvous closed")
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_a_malformed_record_is_ignored(make: Make, etcd_client: EtcdClient,
                                       etcd_config: EtcdConfig) -> None:
    prefix = Keys(etcd_config.root).assigned_joins_prefix(JOB)
    etcd_client.put(prefix + "z", b"{not json")
    etcd_client.put(prefix + "y", json.dumps({"round": 1, "node": "other", "addr": "x",
                                              "port": 1, "incarnation": "i"}).encode())
    infos = together(make("a"))
    assert infos[0].world_size == 1


def test_a_member_whose_record_lapsed_and_came_back_is_waited_for(
    make: Make, etcd_client: EtcdClient, etcd_config: EtcdConfig
) -> None:
    # What an etcd member's death can do: a runner's lease lapses, its record
    # is deleted, and the runner puts the same record back. The others restart
    # (the round is over) but must not take that node for dead: three
    # rounds of one would follow (a split brain seen in tests/netns).
    nodes = {"a", "b", "c"}
    a, b, c = (make(n, expected=nodes) for n in sorted(nodes))
    together(a, b, c)
    key = Keys(etcd_config.root).assigned_join(JOB, "c")
    record = etcd_client.get(key)
    assert record is not None
    etcd_client.delete(key)
    change = wait_for(a.pending_change, timeout=10, what="a to see c's record gone")
    assert (change.kind, change.nodes) == ("lost", frozenset({"c"}))
    c._join.put(1)  # the record back, same incarnation, as after a lapsed lease
    infos = together(a, b, c)
    assert [i.world_size for i in infos] == [3, 3, 3]


def _assign(client: EtcdClient, root: str, node: str, generation: int) -> str:
    key = Keys(root).assignment(node, JOB)
    assignment = Assignment(job_id=JOB, generation=generation, command=["true"],
                            min_nodes=1, max_nodes=3)
    client.put(key, assignment.model_dump_json().encode())
    return key


def test_a_runner_whose_assignment_was_withdrawn_cannot_put_its_join_record_back(
    make: Make, etcd_client: EtcdClient, etcd_config: EtcdConfig
) -> None:
    # What a network partition does (tests/netns/test_partition.py): c's runner
    # is cut off, its lease lapses, the coordinator drops c (deletes its
    # assignment); when the network heals, the stale runner must not put its
    # record back a moment before its agent stops it, or a and b form a round
    # with a member that never comes.
    root = etcd_config.root
    fences = {n: Fence(_assign(etcd_client, root, n, 1), 1) for n in ("a", "b", "c")}
    a, b, c = (make(n, expected={"a", "b", "c"}, fence=fences[n]) for n in ("a", "b", "c"))
    assert [i.world_size for i in together(a, b, c)] == [3, 3, 3]
    etcd_client.delete(fences["c"].key)
    etcd_client.delete(Keys(root).assigned_join(JOB, "c"))
    change = wait_for(a.pending_change, timeout=10, what="a to see c's record gone")
    assert change.nodes == frozenset({"c"})
    with pytest.raises(AssignmentWithdrawnError, match="node c at generation 1 is gone"):
        c._join.put(2)
    assert etcd_client.get(Keys(root).assigned_join(JOB, "c")) is None
    # The coordinator's record, as every reader sees it (the old c too: it may lead the
    # rounds, and would wait assigned_wait_s for itself if it still expected c).
    a._expected_nodes = b._expected_nodes = c._expected_nodes = lambda: {"a", "b"}
    infos = together(a, b)
    assert [i.world_size for i in infos] == [2, 2]
    # c placed again, at a new generation: the old runner stays out; a new one joins.
    _assign(etcd_client, root, "c", 4)
    with pytest.raises(AssignmentWithdrawnError, match="is replaced"):
        c._join.put(3)
    c4 = make("c", expected={"a", "b", "c"}, fence=Fence(fences["c"].key, 4))
    a._expected_nodes = b._expected_nodes = c._expected_nodes = lambda: {"a", "b", "c"}
    assert [i.world_size for i in together(a, b, c4)] == [3, 3, 3]


def test_a_leaving_member_is_left_out_of_the_next_round_without_waiting_for_it(
    make: Make, etcd_client: EtcdClient, etcd_config: EtcdConfig
) -> None:
    # A planned leave (a drain, a PATCH down, a reclaim): c says it leaves and
    # stays up until the others resized. c is still assigned as far as a and b
    # know: if the round waited for it (its record, its assignment), it would
    # time out after join_timeout_s.
    fences = {n: Fence(_assign(etcd_client, etcd_config.root, n, 1), 1) for n in "abc"}
    a, b, c = (make(n, expected={"a", "b", "c"}, join_timeout_s=10, fence=fences[n])
               for n in "abc")
    assert [i.world_size for i in together(a, b, c)] == [3, 3, 3]
    etcd_client.delete(fences["c"].key)  # the coordinator withdrew c's assignment first
    assert c.announce_leaving()
    for handler in (a, b):
        change = wait_for(handler.pending_change, timeout=10, what="c's leaving seen")
        assert (change.kind, change.nodes) == ("leaving", frozenset({"c"}))
    assert a.num_nodes_waiting() == 0
    infos = together(a, b)
    assert [i.world_size for i in infos] == [2, 2]
    assert a.participants() == b.participants() == {"a", "b"}
    assert a.pending_change() is None and b.pending_change() is None

    # c's record and liveness port go only now, after the new round: no loss of it.
    c.leave()
    d = make("d")
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(d.next_rendezvous)
        # d's record comes after c's delete in the watch: a saw both once it sees d.
        change = wait_for(a.pending_change, timeout=10, what="a to see d waiting")
        assert (change.kind, change.nodes) == ("waiting", frozenset({"d"}))
        d.close()
        with pytest.raises(RendezvousClosedError):
            late.result(timeout=30)


def test_leaving_is_not_announced_once_the_record_is_gone(
    make: Make, etcd_client: EtcdClient, etcd_config: EtcdConfig
) -> None:
    a, b = make("a", expected={"a", "b"}), make("b", expected={"a", "b"})
    together(a, b)
    key = Keys(etcd_config.root).assigned_join(JOB, "b")
    etcd_client.delete(key)  # its lease ended meanwhile: the put must not bring it back
    assert not b.announce_leaving()
    assert etcd_client.get(key) is None


def test_a_larger_max_nodes_gives_a_waiting_newcomer_room_without_a_new_handler(
    make: Make,
) -> None:
    # A PATCH rewrites the assignments' bounds in place (agent.bounds): the
    # members' handlers take them, and c, kept out of a full round, is waited for.
    a, b = (make(n, max_nodes=2, expected={"a", "b"}) for n in ("a", "b"))
    together(a, b)
    c = make("c", max_nodes=3)
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(c.next_rendezvous)
        leader = wait_for(lambda: next((h._leading for h in (a, b) if h._leading), None),
                          timeout=10, what="a round leader")
        wait_for(lambda: "c" in leader._joins, timeout=10, what="the leader to see c's record")
        decision = leader._decide()  # what the leader does with it: nothing
        assert (decision.members, decision.change) == (None, None)
        assert a.pending_change() is None  # the round is full
        a.set_bounds(1, 3)
        b.set_bounds(1, 3)
        change = wait_for(a.pending_change, timeout=10, what="a to see c waiting")
        assert (change.kind, change.nodes) == ("waiting", frozenset({"c"}))
        infos = together(a, b)
        assert [i.world_size for i in (*infos, late.result(timeout=30))] == [3, 3, 3]


def test_a_leaver_knows_when_no_other_member_stays_to_resize_with(make: Make) -> None:
    # A cancel: every runner gets SIGTERM and announces its leave; none waits
    # for a resize that nobody will make.
    a, b = make("a", expected={"a", "b"}), make("b", expected={"a", "b"})
    together(a, b)
    assert (a.staying_peers(), b.staying_peers()) == ({"b"}, {"a"})
    assert a.announce_leaving()
    wait_for(lambda: not b.staying_peers(), timeout=10, what="b to see a leaving")
    assert a.staying_peers() == {"b"}
    assert b.announce_leaving()
    wait_for(lambda: not a.staying_peers(), timeout=10, what="a to see b leaving")


def test_a_deposed_leader_cannot_write_and_another_member_takes_over(
    make: Make, etcd_client: EtcdClient, etcd_config: EtcdConfig
) -> None:
    # What a ring peer does when the leader dies, or etcd when its lease ends:
    # the leader key goes. The old leader's writes are fenced by its key's
    # create revision, whatever it believes; a member takes the key and leads.
    keys = Keys(etcd_config.root)
    handlers = [make(n, expected={"a", "b", "c"}) for n in ("a", "b", "c")]
    together(*handlers)
    old = wait_for(lambda: next((h._leading for h in handlers if h.is_leader()), None),
                   timeout=10, what="a round leader")
    etcd_client.delete(keys.assigned_leader(JOB))
    new = wait_for(lambda: next((h._leading for h in handlers if h._leading is not None
                                 and h._leading.create_revision != old.create_revision), None),
                   timeout=20, what="another leader")
    before = etcd_client.get(keys.assigned_state(JOB))
    assert not old._write([Put(keys.assigned_state(JOB), b"stale")])
    assert etcd_client.get(keys.assigned_state(JOB)) == before
    assert new.leading
    a, b = handlers[:2]
    a._expected_nodes = b._expected_nodes = lambda: {"a", "b"}  # as the coordinator does
    handlers[2].close()  # a change (c may be the leader: then the deputy leads)
    wait_for(a.pending_change, timeout=20, what="a to see c leave")
    assert [i.world_size for i in together(a, b)] == [2, 2]
    assert a.is_leader() or b.is_leader()


def crash(handler: AssignedRendezvousHandler) -> None:
    """What a SIGKILL does to a member: its sockets close and its keep-alives stop; nothing
    is revoked or deleted (etcd and its peers find out by themselves)."""
    h: Any = handler
    h._stopped.set()
    if h._leading is not None:
        h._leading.stop()
    for part in (h._server, h._monitor):
        part.close()
    h._join._lease.close(revoke=False)
    for watcher in (h._watcher, h._leader_watcher):
        if watcher is not None:
            watcher.stop(timeout=5)


def test_with_the_leader_and_its_deputy_dead_a_waiting_member_takes_over(make: Make) -> None:
    # Only the leader and its deputy watch the leader key (#24): when both die, a member
    # that waits a lease's TTL for a round reads the key once it is free and leads.
    nodes = ("a", "b", "c", "d")
    handlers = {n: make(n, expected=set(nodes), max_nodes=4, min_nodes=2) for n in nodes}
    assert {i.world_size for i in together(*handlers.values())} == {4}
    state = handlers["a"]._state
    assert state is not None and state.leader and state.deputy
    watching = {n for n, h in handlers.items() if h._leader_watcher is not None}
    wait_for(lambda: {n for n, h in handlers.items()
                      if h._leader_watcher is not None} == {state.leader, state.deputy},
             timeout=10, what=f"only the leader and the deputy to watch its key ({watching})")
    for node in (state.leader, state.deputy):
        crash(handlers.pop(node))
    survivors = list(handlers.values())
    for h in survivors:
        h._expected_nodes = lambda: set(handlers)  # as the coordinator does
    wait_for(lambda: all(h.pending_change() for h in survivors), timeout=10,
             what="the survivors to see their peers die")
    infos = together(*survivors)
    assert [i.world_size for i in infos] == [2, 2]
    assert sum(h.is_leader() for h in survivors) == 1
