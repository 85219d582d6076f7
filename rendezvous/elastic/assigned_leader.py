"""The round leader of the assigned rendezvous: the one member that writes rounds.

A member leads while it holds ``ctl/leader``, a key it created (compare on create
revision 0) under its join record's lease. Every write of the leader is guarded by
``Compare(ctl/leader, "create", "==", R)`` where R is that key's create revision: a
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

from rendezvous.elastic.assigned_rounds import Change, JoinRecord, Member, RoundRecord
from rendezvous.elastic.assigned_state import (
    Decision,
    Peer,
    RankRecord,
    StateRecord,
    chunks,
    decide,
    deputy_of,
    ring_of,
)
from rendezvous.errors import EtcdError
from rendezvous.etcd import Compare, Delete, EtcdClient, Put, TxnOp, WatchEvent
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
    """Write rounds while this node holds ``ctl/leader`` at ``create_revision``.

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
        self._current: RoundRecord | None = None
        self._published: Change | None = None
        self._waiting_since: float | None = None
        self._expected_at = -1.0
        self._expected_now: frozenset[str] = frozenset()
        self._done = threading.Event()
        self._watcher = PrefixWatcher(client, keys.assigned_members_prefix(run_id),
                                      on_event=self._on_event, name=f"rdzv-leader-watch {node}")
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
        self._watcher.stop(timeout=5)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watcher.start()
            while not self._watcher.wait_synced(1.0):
                if self._done.is_set():
                    return
            self._current = self._read_current()
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

    def _read_current(self) -> RoundRecord | None:
        """The last round, from the state and the rank records (once, when taking over)."""
        kv = self._client.get(self._keys.assigned_state(self._run_id))
        if kv is None:
            return None
        state = StateRecord.from_json(kv.value)
        return RoundRecord(state.round, read_round(self._client, self._keys, self._run_id,
                                                   state.round))

    def _decide(self) -> Decision:
        with self._cond:
            joins, dead = dict(self._joins), set(self._dead)
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
        with self._cond:
            leases = dict(self._leases)
        lease = self._records.get()
        ops: list[TxnOp] = [
            Put(self._keys.assigned_rank(self._run_id, m.node),
                RankRecord(target, i, m, ring_of(members, leases, i)).to_json(), lease)
            for i, m in enumerate(members)
        ]
        staying = {m.node for m in members}
        ops += [Delete(self._keys.assigned_rank(self._run_id, n))
                for n in (self._current.nodes() if self._current else ()) if n not in staying]
        for chunk in chunks(list(ops)):
            if not self._write(chunk):  # type: ignore[arg-type]
                return
        state = StateRecord(target, len(members), why=decision.change, leader=self._node,
                            deputy=deputy_of(members, self._node))
        last: list[TxnOp] = [Put(self._keys.assigned_state(self._run_id), state.to_json(), lease)]
        if target > 2:  # the store of two rounds ago has no reader left
            last.append(Delete(self._keys.round_store_prefix(self._run_id, target - 2),
                               prefix=True))
        if self._write(last):
            log.info("round %d complete: %d members%s", target, len(members),
                     f" ({decision.change.kind})" if decision.change else "")
            self._current = RoundRecord(target, members)
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


def read_round(client: EtcdClient, keys: Keys, run_id: str, round_: int) -> tuple[Member, ...]:
    """The members of round ``round_`` in rank order, from their rank records (O(N):
    read by a leader taking over, and by ``participants`` once per round)."""
    kvs, _ = client.get_prefix(keys.assigned_ranks_prefix(run_id))
    ranks = []
    for kv in kvs:
        try:
            rank = RankRecord.from_json(kv.value)
        except (ValueError, KeyError, TypeError):
            continue
        if rank.round == round_:
            ranks.append(rank)
    return tuple(r.member for r in sorted(ranks, key=lambda r: r.rank))


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


__all__ = ["RECORD_TTL_S", "RoundLeader", "mark_lost", "read_round"]
