"""The round leader of the assigned rendezvous: the one member that writes rounds.

A member leads while it holds ``leader``, a key it created (compare on create
revision 0) under its join record's lease. Every write of the leader is guarded by
``Compare(leader, "create", "==", R)`` where R is that key's create revision: a
leader whose lease ended (hung, cut off) or whose key was deleted by a ring peer that
saw it die is deposed, and its writes fail on that compare, whatever it believes.

The leader watches ``m/`` (every join record and every ``lost`` mark: O(N) events in
all per round, all of them here) and decides (:func:`rendezvous.elastic.assigned_state.decide`)
on each event and every :data:`REEVALUATE_S` (for the assigned nodes, which are read
here only, at most once a second while a round waits for them). A round is written
as the members' rank records, in transactions of at most
:data:`~rendezvous.elastic.assigned_state.TXN_OPS` operations, then the state record,
last: a member that sees the state reads a rank record that is already there. A
deposed leader's partial write is overwritten by its successor, which writes the
same round number again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace

from rendezvous.elastic.assigned_rounds import Change, JoinRecord, Member, RoundRecord
from rendezvous.elastic.assigned_state import (
    Decision,
    Peer,
    RankRecord,
    Roster,
    StateRecord,
    chunks,
    decide,
    deputy_of,
    gone_ranks,
    rereads,
    ring_of,
)
from rendezvous.errors import EtcdError
from rendezvous.etcd import Compare, Delete, EtcdClient, KeyValue, Put, TxnOp, WatchEvent
from rendezvous.keys import Keys
from rendezvous.lease import LeaseCache
from rendezvous.watch import PrefixWatcher

log = logging.getLogger(__name__)

# The rank, state, lost and closed records carry no runner's lease: they expire
# this long after the last change.
RECORD_TTL_S = 2 * 3600
REEVALUATE_S = 0.25
EXPECTED_EVERY_S = 1.0


class RoundLeader:
    """Write rounds while this node holds the leader key at ``create_revision``.

    Args:
        client: the runner's etcd client.
        keys / run_id / node: the key layout, the job, this node.
        create_revision: the leader key's create revision: the fence of every write.
        bounds: the job's (min_nodes, max_nodes), as the handler holds them now.
        expected: the assigned nodes (the handler's ``expected_nodes``), or None.
        assigned_wait_s: how long a round waits for assigned nodes that have not come.
        records: the lease the rank, state and lost records are written under.
    """

    def __init__(
        self, client: EtcdClient, keys: Keys, *, run_id: str, node: str, create_revision: int,
        bounds: Callable[[], tuple[int, int]],
        expected: Callable[[], Collection[str]] | None, assigned_wait_s: float,
        records: LeaseCache,
    ) -> None:
        self._client = client
        self._keys = keys
        self._run_id = run_id
        self._node = node
        self._bounds = bounds
        self._expected = expected
        self._assigned_wait_s = assigned_wait_s
        self._records = records
        self._fence = Compare(keys.assigned_leader(run_id), "create", "==", create_revision)
        self.create_revision = create_revision
        self._joins_prefix = keys.assigned_joins_prefix(run_id)
        self._lost_prefix = keys.assigned_lost_prefix(run_id)
        self._cond = threading.Condition()
        self._joins: dict[str, JoinRecord] = {}
        self._leases: dict[str, int] = {}
        self._dead: set[str] = set()
        self._seen = 0  # the last revision of m/ applied to the view above
        # The view the last decision was made on: joins, their leases, dead incarnations,
        # the revision of m/ it reflects (what the roster hands to a successor).
        self._view: tuple[dict[str, JoinRecord], dict[str, int], set[str], int] = ({}, {}, set(), 0)
        self._current: RoundRecord | None = None
        # The current round's rank records by node (None: not known, its members read).
        self._ranks: dict[str, RankRecord] | None = None
        self._roster_chunks = 0  # how many roster chunks the last round wrote
        self._published: Change | None = None
        self._waiting_since: float | None = None
        self._expected_at = -1.0
        self._expected_now: frozenset[str] = frozenset()
        self._done = threading.Event()
        self._watcher: PrefixWatcher | None = None
        self._thread = threading.Thread(target=self._run, name=f"rdzv-leader {node}", daemon=True)

    def start(self) -> RoundLeader:
        self._thread.start()
        return self

    @property
    def leading(self) -> bool:
        return not self._done.is_set()

    def stop(self) -> None:
        """Stop leading (deposed, or the handler closes); writes nothing more."""
        self._done.set()
        with self._cond:
            self._cond.notify_all()
            watcher = self._watcher
        if watcher is not None:
            watcher.stop(timeout=5)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if not self._take_over():
                return
            log.info("node %s leads the rendezvous of job %s from round %d", self._node,
                     self._run_id, self._current.round if self._current else 0)
            while not self._done.is_set():
                try:
                    self._evaluate()
                except EtcdError as exc:
                    log.warning("the round leader could not write (%s); re-evaluating", exc)
                with self._cond:
                    self._cond.wait(REEVALUATE_S)
        except Exception:
            log.exception("the round leader of job %s failed", self._run_id)
            self._done.set()

    def _watch(self, resume: tuple[list[KeyValue], int] | None) -> PrefixWatcher:
        watcher = PrefixWatcher(self._client, self._keys.assigned_members_prefix(self._run_id),
                                on_event=self._on_event, name=f"rdzv-leader-watch {self._node}",
                                resume=resume)
        with self._cond:
            if self._done.is_set():
                raise _Stopped
            self._watcher = watcher
        return watcher.start()

    def _take_over(self) -> bool:
        """Start from the last round: its state and roster (O(N) small entries), then the
        changes of ``m/`` since its leader formed it (:class:`Roster`); without a roster,
        every join record and rank record (the first round, or a leader's partial write).
        False: stopped meanwhile."""
        try:
            kv = self._client.get(self._keys.assigned_state(self._run_id))
            state = StateRecord.from_json(kv.value) if kv is not None else None
            roster = None
            if state is not None:
                kvs, _ = self._client.get_prefix(self._keys.assigned_roster_prefix(self._run_id))
                roster = Roster.parse([kv.value for kv in kvs], state.round, state.world)
                self._roster_chunks = len(kvs)
            if roster is not None and roster.seen > 0:
                self._current = RoundRecord(roster.round, roster.members)
                self._ranks = {
                    m.node: RankRecord(roster.round, i, m, ring_of(roster.members,
                                                                   roster.leases, i))
                    for i, m in enumerate(roster.members)}
                with self._cond:
                    self._seen = roster.seen
                watcher = self._watch((self._view_of(roster), roster.seen))
            else:
                watcher = self._watch(None)
            while not watcher.wait_synced(1.0):
                if self._done.is_set():
                    return False
            if roster is None or roster.seen <= 0:
                self._current = self._read_current()
        except _Stopped:
            return False
        return True

    def _view_of(self, roster: Roster) -> list[KeyValue]:
        """``m/`` as the last leader saw it when it formed ``roster``'s round: a join
        record for each member (a member of that round wanted no later one and was not
        leaving) and each node outside it, a lost mark for each dead incarnation."""
        def kv(key: str, value: bytes, lease: int) -> KeyValue:
            return KeyValue(key, value, 0, 0, 0, lease)

        run = self._run_id
        view = [kv(self._keys.assigned_join(run, m.node),
                   JoinRecord(m, roster.round).to_json(), roster.leases.get(m.node, 0))
                for m in roster.members]
        for join, lease, dead in roster.outside:
            node = join.member.node
            view.append(kv(self._keys.assigned_join(run, node), join.to_json(), lease))
            if dead:
                view.append(kv(self._keys.assigned_lost(run, node),
                               join.member.incarnation.encode(), 0))
        return view

    def _read_current(self) -> RoundRecord | None:
        """The last round, from the state and the rank records."""
        kv = self._client.get(self._keys.assigned_state(self._run_id))
        if kv is None:
            return None
        state = StateRecord.from_json(kv.value)
        ranks = read_ranks(self._client, self._keys, self._run_id, state.round)
        if len(ranks) == state.world and [r.rank for r in ranks] == list(range(state.world)):
            self._ranks = {r.member.node: r for r in ranks}
        return RoundRecord(state.round, tuple(r.member for r in ranks))

    def _decide(self) -> Decision:
        with self._cond:
            joins, dead = dict(self._joins), set(self._dead)
            self._view = (joins, dict(self._leases), dead, self._seen)
        low, high = self._bounds()
        decision = decide(self._current, joins, dead, frozenset(), min_nodes=low, max_nodes=high)
        if decision.members is None:
            if decision.change is None:
                self._waiting_since = None
            return decision
        now = time.monotonic()
        if self._waiting_since is None:  # a new round to form: the assigned nodes afresh
            self._waiting_since, self._expected_at = now, -1.0
        if self._expected is None or now - self._waiting_since >= self._assigned_wait_s:
            return decision
        if now - self._expected_at >= EXPECTED_EVERY_S:
            try:
                self._expected_now = frozenset(self._expected())
            except Exception as exc:  # the assignments are a hint: never fail on them
                log.warning("cannot read the job's assigned nodes (%s); not waiting", exc)
                self._expected_now = frozenset()
            self._expected_at = now
        return decide(self._current, joins, dead, self._expected_now, min_nodes=low,
                      max_nodes=high)

    def _evaluate(self) -> None:
        decision = self._decide()
        if decision.members is None:
            if (decision.change is not None and self._current is not None
                    and decision.change != self._published):
                self._write([Put(self._keys.assigned_state(self._run_id), StateRecord(
                    self._current.round, len(self._current.members), pending=decision.change,
                    leader=self._node,
                    deputy=deputy_of(self._current.members, self._node)).to_json(),
                    self._records.get())])
                self._published = decision.change
            return
        self._write_round(decision)

    def _write_round(self, decision: Decision) -> None:
        assert decision.members is not None
        members = decision.members
        target = (self._current.round if self._current else 0) + 1
        joins, leases, dead, seen = self._view
        lease = self._records.get()
        records = {m.node: RankRecord(target, i, m, ring_of(members, leases, i))
                   for i, m in enumerate(members)}
        ops: list[TxnOp] = [Put(self._keys.assigned_rank(self._run_id, node), r.to_json(), lease)
                            for node, r in records.items()]
        staying = {m.node for m in members}
        ops += [Delete(self._keys.assigned_rank(self._run_id, n))
                for n in (self._current.nodes() if self._current else ()) if n not in staying]
        outside = tuple((j, leases.get(n, 0), j.member.incarnation in dead)
                        for n, j in sorted(joins.items()) if n not in staying)
        roster = Roster(target, members, leases, seen, outside).chunks()
        ops += [Put(self._keys.assigned_roster(self._run_id, i), value, lease)
                for i, value in enumerate(roster)]
        ops += [Delete(self._keys.assigned_roster(self._run_id, i))
                for i in range(len(roster), self._roster_chunks)]
        for chunk in chunks(list(ops)):
            if not self._write(chunk):  # type: ignore[arg-type]
                return
        state = StateRecord(target, len(members), why=decision.change, leader=self._node,
                            deputy=deputy_of(members, self._node))
        if self._current is not None and self._ranks is not None:
            # The members of the last round derive their records but for those named.
            gone = gone_ranks(self._current.members, members)
            state = replace(state, derive=True, gone=gone)
            previous = tuple(self._ranks[m.node] for m in self._current.members
                             if m.node in self._ranks)
            state = replace(state, reread=rereads(previous, records, state))
        last: list[TxnOp] = [Put(self._keys.assigned_state(self._run_id), state.to_json(), lease)]
        if target > 2:  # the store of two rounds ago has no reader left
            last.append(Delete(self._keys.round_store_prefix(self._run_id, target - 2),
                               prefix=True))
        if self._write(last):
            log.info("round %d complete: %d members%s", target, len(members),
                     f" ({decision.change.kind})" if decision.change else "")
            self._current = RoundRecord(target, members)
            self._ranks = records
            self._roster_chunks = len(roster)
            self._published = None
            self._waiting_since = None

    def _write(self, ops: list[TxnOp]) -> bool:
        """One fenced transaction; a failed fence deposes this leader."""
        if self._done.is_set():
            return False
        if self._client.txn([self._fence], ops).succeeded:
            return True
        log.warning("node %s is no longer the round leader of job %s", self._node, self._run_id)
        self._done.set()
        return False

    # the watch -----------------------------------------------------------------------------

    def _on_event(self, event: WatchEvent) -> None:
        with self._cond:
            self._seen = max(self._seen, event.mod_revision)
            try:
                self._apply(event)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring a malformed rendezvous record %s: %s", event.key, exc)
            self._cond.notify_all()

    def _apply(self, event: WatchEvent) -> None:
        node = Keys.id_under(self._joins_prefix, event.key)
        if node is not None:
            if event.kind == "delete":
                self._joins.pop(node, None)
                self._leases.pop(node, None)
                return
            join = JoinRecord.from_json(event.value)
            if join.member.node != node:
                raise ValueError(f"record of node {join.member.node!r} under key of {node!r}")
            self._joins[node] = join
            self._leases[node] = event.lease
            return
        node = Keys.id_under(self._lost_prefix, event.key)
        if node is not None and event.kind == "put":
            self._dead.add(event.value.decode())


class _Stopped(Exception):
    """The leader was stopped while taking over."""


def read_ranks(client: EtcdClient, keys: Keys, run_id: str, round_: int) -> (
    tuple[RankRecord, ...]
):
    """The rank records of round ``round_`` in rank order (O(N): read by a leader taking
    over, and by ``participants`` when it cannot derive the roster)."""
    kvs, _ = client.get_prefix(keys.assigned_ranks_prefix(run_id))
    ranks = []
    for kv in kvs:
        try:
            rank = RankRecord.from_json(kv.value)
        except (ValueError, KeyError, TypeError):
            continue
        if rank.round == round_:
            ranks.append(rank)
    return tuple(sorted(ranks, key=lambda r: r.rank))


def read_round(client: EtcdClient, keys: Keys, run_id: str, round_: int) -> tuple[Member, ...]:
    """The members of round ``round_`` in rank order, from their rank records."""
    return tuple(r.member for r in read_ranks(client, keys, run_id, round_))


def mark_lost(client: EtcdClient, keys: Keys, run_id: str, records: LeaseCache, peer: Peer, *,
              led: bool) -> None:
    """Say that ring peer ``peer`` died: ``m/lost/<node>`` holds its incarnation; if it
    led, its leader key goes too (in the same transaction), so the deputy takes over."""
    key = keys.assigned_lost(run_id, peer.member.node)
    mark = peer.member.incarnation.encode()
    try:
        lease = records.get()
        if led:
            leader = keys.assigned_leader(run_id)
            led_by = Compare(leader, "value", "==", peer.member.node.encode())
            client.txn([led_by], [Put(key, mark, lease), Delete(leader)], [Put(key, mark, lease)])
        else:
            client.put(key, mark, lease=lease)
    except EtcdError as exc:
        log.warning("cannot mark node %s lost (%s): its lease will", peer.member.node, exc)


__all__ = ["RECORD_TTL_S", "RoundLeader", "mark_lost", "read_ranks", "read_round"]
