"""A rendezvous for nodes that know who is coming: tidal's agents.

torch's ``DynamicRendezvousHandler`` cannot know which nodes will come, so it
waits: for a vanished participant's heartbeats to grow old (keep-alive x
attempts) and then a *last call* for latecomers. On this machine that is 5.5
of tidal's 9.2 s recovery (docs/benchmarks.md). tidal's runners know more:

* who is *expected*: the nodes the coordinator assigned to the job (passed
  in as ``expected_nodes``), and every node that has announced itself;
* who is *dead*, within milliseconds: each runner listens on a liveness port
  (:mod:`rendezvous.elastic.liveness`); a peer whose port refuses a connection, or
  whose connection drops, is gone; a hung or cut-off peer is caught by its
  lease instead, which etcd deletes ``lease_ttl_s`` after its last renewal.

So a round completes the moment every expected, living node has joined it:
no timers. Layout, under ``P/rdzv/<job>/assigned/``::

    joins/<node>   JoinRecord: the round the node wants, its liveness
                   address, an incarnation id, whether it is leaving (a
                   planned leave); under the runner's lease
    round          RoundRecord: the last completed round, its members in rank
                   order with their liveness addresses; written by
                   compare-and-set on its mod revision by whichever joiner
                   saw the round complete
    closed         present once the job ended (``shutdown``)

and each round gets a fresh c10d store at ``P/rdzv/<job>/store/<round>/``
(:class:`~rendezvous.elastic.store.EtcdV3Store`).

A round's members learn that it is obsolete through :meth:`pending_change`:
a member was lost (its lease ended, its liveness connection dropped, or it
came back as a new incarnation), a member is leaving (a planned leave,
:meth:`announce_leaving`), a node is waiting (a newcomer, or a member whose
workers failed and that re-joined), or a later round was completed without
this node. The runner (:mod:`agent.runner.elastic`) asks on every monitor
tick; it costs no etcd call. The records, and what is decided from them
(rank order, completion, obsolescence), are pure and live in
:mod:`rendezvous.elastic.assigned_rounds`; this node's own join record is put, put
back and withdrawn by :mod:`rendezvous.elastic.assigned_join`; this handler reads,
probes and writes rounds.

An etcd outage does not break a running round: leases survive a restarted
etcd, and a runner that lost its lease while etcd was unreachable puts its
record back under a new lease once etcd answers, without restarting its
workers (unless the others went on without it meanwhile).

A join record is *fenced* by the node's assignment (``fence``): a runner
whose assignment is gone or rewritten cannot join again
(:class:`~rendezvous.elastic.assigned_join.AssignmentWithdrawnError`; why, in
:mod:`rendezvous.elastic.assigned_join`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection

from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from rendezvous.elastic.assigned_join import AssignmentWithdrawnError, JoinRecordKeeper
from rendezvous.elastic.assigned_rounds import (
    Change,
    Fence,
    JoinRecord,
    Member,
    RoundRecord,
    behind,
    complete_round,
    pending_change,
    staying_peers,
    waiting_nodes,
)
from rendezvous.elastic.liveness import LivenessServer, PeerMonitor, Probe, probe
from rendezvous.elastic.store import EtcdV3Store
from rendezvous.errors import EtcdError
from rendezvous.etcd import Compare, Delete, EtcdClient, Put, WatchEvent
from rendezvous.keys import Keys, validate_id
from rendezvous.watch import PrefixWatcher

log = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "AssignedRendezvousHandler", "AssignmentWithdrawnError"]

BACKEND_NAME = "tidal-assigned"
# The round and closed records outlive every runner (they carry no runner's
# lease) but not the job by much: they expire this long after the last change.
RECORD_TTL_S = 2 * 3600
# While waiting, membership is re-evaluated on every watch event and at least
# this often (for probes, and for assignments, which are not watched).
REEVALUATE_S = 0.25


class AssignedRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on assigned membership; see the module doc.

    Args:
        client: the runner's etcd client.
        run_id: the job id.
        node_id: this node.
        addr: the address other nodes reach this one at (liveness port, and
            ``MASTER_ADDR`` when this node is rank 0).
        min_nodes / max_nodes: the job's bounds.
        root: the etcd key root.
        expected_nodes: returns the nodes assigned to the job (that are
            alive); a round waits for those of them that have not joined, for
            at most ``assigned_wait_s`` from the start of the wait. None:
            wait only for nodes that announced themselves.
        lease_ttl_s: the TTL of this node's join record: how long a hung or
            cut-off node holds up the others.
        join_timeout_s: how long :meth:`next_rendezvous` waits for
            ``min_nodes`` before it gives up.
        store_timeout_s: the c10d store's timeout.
        fence: the node's assignment; the join record is put only while it
            holds this generation (see the module doc). None: no fence (a
            rendezvous used without tidal's coordinator, as by torchrun).
    """

    def __init__(
        self,
        client: EtcdClient,
        *,
        run_id: str,
        node_id: str,
        addr: str,
        min_nodes: int,
        max_nodes: int,
        root: str,
        expected_nodes: Callable[[], Collection[str]] | None = None,
        assigned_wait_s: float = 30.0,
        lease_ttl_s: int = 5,
        join_timeout_s: float = 600.0,
        store_timeout_s: float = 300.0,
        fence: Fence | None = None,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
        self._client = client
        self._run_id = validate_id(run_id, what="rendezvous run id")
        self._node = validate_id(node_id, what="node id")
        self._addr = addr
        self._min = min_nodes
        self._max = max_nodes
        self._keys = Keys(root)
        self._expected_nodes = expected_nodes
        self._assigned_wait_s = assigned_wait_s
        self._join_timeout_s = join_timeout_s
        self._store_timeout = datetime.timedelta(seconds=store_timeout_s)
        self._joins_prefix = self._keys.assigned_joins_prefix(run_id)
        self._round_key = self._keys.assigned_round(run_id)
        self._closed_key = self._keys.assigned_closed(run_id)
        self._prefix = self._keys.assigned_prefix(run_id)

        self._cond = threading.Condition()
        self._joins: dict[str, JoinRecord] = {}
        self._round: RoundRecord | None = None
        self._round_rev = 0  # mod revision of the round key; 0: absent
        self._closed = False
        self._dead: set[str] = set()  # incarnations known dead
        self._mine: RoundRecord | None = None  # the round this node is in
        self._lost: set[str] = set()  # members of that round lost since
        self._incarnation = uuid.uuid4().hex[:12]

        self._server: LivenessServer | None = None
        self._monitor: PeerMonitor | None = None
        self._watcher: PrefixWatcher | None = None
        self._stopped = threading.Event()
        self._join = JoinRecordKeeper(
            client, self._keys, run_id=self._run_id, node_id=self._node,
            lease_ttl_s=lease_ttl_s, join_timeout_s=join_timeout_s, fence=fence,
            stopped=self._stopped,
        )
        self._record_lease = 0
        self._record_lease_until = 0.0

    # RendezvousHandler -----------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        self._start()
        with self._cond:
            return self._closed

    def set_closed(self) -> None:
        self._start()
        self._put_record(self._closed_key, b"1")

    def num_nodes_waiting(self) -> int:
        """Nodes (newcomers, or members that re-joined) that want a later round."""
        with self._cond:
            return len(waiting_nodes(self._node, self._mine, self._joins, self._dead, self._max))

    def shutdown(self) -> bool:
        """Close the rendezvous for every node (the job is over) and release."""
        try:
            self.set_closed()
        except (EtcdError, RendezvousConnectionError) as exc:
            log.warning("could not mark the rendezvous closed: %s", exc)
            self.close()
            return False
        self.close()
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; return when it completed with this node in it."""
        self._start()
        with self._cond:
            self._mine = None
            self._lost.clear()
            target = (self._round.round if self._round else 0) + 1
        if self._monitor is not None:
            self._monitor.clear()
        self._join.put(target)
        started = time.monotonic()
        deadline = started + self._join_timeout_s
        assigned_until = started + self._assigned_wait_s
        expected: frozenset[str] = frozenset()
        expected_at = -1.0
        while True:
            now = time.monotonic()
            with self._cond:
                if self._closed:
                    raise RendezvousClosedError(f"the rendezvous of job {self._run_id} is closed")
                if self._stopped.is_set():
                    raise RendezvousClosedError("this node left the rendezvous")
                current = self._round
                if current is not None and current.round >= target:
                    if self._node in current.nodes():
                        self._mine = current
                        break
                    target = current.round + 1  # it completed without us: the next one
                    wait_for_next = True
                else:
                    wait_for_next = False
            if wait_for_next:
                self._join.put(target)
                continue
            if now < assigned_until and self._expected_nodes is not None and now - expected_at > 1:
                expected = frozenset(self._read_expected())
                expected_at = now
            elif now >= assigned_until:
                expected = frozenset()
            members = self._complete(target, current, expected)
            if members is not None and self._commit(target, members):
                continue  # the watch (or _commit) installed the round
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"job {self._run_id}: round {target} did not gather min_nodes={self._min} "
                    f"within {self._join_timeout_s:.0f} s"
                )
            with self._cond:
                self._cond.wait(REEVALUATE_S)
        return self._round_info(self._mine)

    # what the runner asks on every tick ------------------------------------

    def pending_change(self) -> Change | None:
        """Why this node's round is obsolete, or None while it holds
        (:func:`rendezvous.elastic.assigned_rounds.pending_change`)."""
        with self._cond:
            return pending_change(self._node, self._mine, self._round, joins=self._joins,
                                  lost=self._lost, dead=self._dead, max_nodes=self._max)

    def set_bounds(self, min_nodes: int, max_nodes: int) -> None:
        """Take new bounds (a PATCH rewrote the assignment in place): later rounds use them.

        A larger ``max_nodes`` gives a waiting newcomer room at once
        (:meth:`pending_change`); the current round is not touched otherwise.
        Bounds that do not make sense are ignored with a warning.
        """
        if not 1 <= min_nodes <= max_nodes:
            log.warning("ignoring bounds %d..%d for job %s", min_nodes, max_nodes, self._run_id)
            return
        with self._cond:
            self._min, self._max = min_nodes, max_nodes
            self._cond.notify_all()

    def staying_peers(self) -> frozenset[str]:
        """The other members of this node's round that neither left, nor were lost,
        nor announced a leave: those a planned leave of this node can resize with."""
        with self._cond:
            return staying_peers(self._node, self._mine, self._joins, self._lost)

    def current_round(self) -> int:
        """The number of this node's current (or last) round; 0 before its first."""
        with self._cond:
            return self._mine.round if self._mine else 0

    def participants(self) -> frozenset[str]:
        """The members of this node's current (or last) round."""
        with self._cond:
            return frozenset(self._mine.nodes()) if self._mine else frozenset()

    def announce_leaving(self) -> bool:
        """Say that this node is on its way out (a planned leave), without leaving yet.

        The join record is put again with the same round and incarnation and
        ``leaving`` set: the other members see :meth:`pending_change` kind
        ``"leaving"`` and form the next round without this node while its
        workers go on; :meth:`leave` follows once they are done. The put is
        not fenced by the assignment (which a planned leave has usually
        removed already): it only takes this node out of rounds, and holds
        only while the record is still there under this runner's lease.

        Returns:
            Whether the record says leaving now (False: it was gone, or etcd
            did not answer; the caller leaves the ordinary way).
        """
        return self._join.announce_leaving()

    def leave(self) -> None:
        """Leave without closing: the others go on without this node."""
        self.close()

    def close(self) -> None:
        """Withdraw this node's record, stop every thread and socket."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._join.close()  # revokes the lease: deletes the join record at once
        for part in (self._monitor, self._server):
            if part is not None:
                part.close()
        if self._watcher is not None:
            self._watcher.stop(timeout=5)
        self._join.join(timeout=5)

    # internals ---------------------------------------------------------------

    def _start(self) -> None:
        if self._watcher is not None:
            return
        if self._stopped.is_set():
            raise RendezvousClosedError("this rendezvous handler was closed")
        # Thread names end in the node: the count benchmark adds up each member's CPU.
        self._server = LivenessServer(self._addr, name=f"liveness-server {self._node}")
        self._monitor = PeerMonitor(self._on_peer_lost, name=f"peer-monitor {self._node}")
        self._watcher = PrefixWatcher(
            self._client, self._prefix, on_event=self._on_event,
            name=f"rendezvous {self._run_id} {self._node}",
        ).start()
        if not self._watcher.wait_synced(self._join_timeout_s):
            raise RendezvousConnectionError(f"job {self._run_id}: cannot read the rendezvous")
        self._join.start(Member(self._node, self._addr, self._server.port, self._incarnation))

    def _read_expected(self) -> Collection[str]:
        assert self._expected_nodes is not None
        try:
            return self._expected_nodes()
        except Exception as exc:  # the assignments are a hint: never fail on them
            log.warning("cannot read the job's assigned nodes (%s); not waiting for them", exc)
            return ()

    def _complete(
        self, target: int, previous: RoundRecord | None, expected: frozenset[str]
    ) -> tuple[Member, ...] | None:
        """The members of round ``target`` if it is complete now, else None
        (:func:`rendezvous.elastic.assigned_rounds.complete_round`, once the nodes
        behind it were asked whether they live)."""
        with self._cond:
            joins = dict(self._joins)
            dead = set(self._dead)
        for join in behind(joins, dead, target):
            if probe(join.member.addr, join.member.port) is Probe.DEAD:
                log.info("node %s does not answer on its liveness port: not waiting",
                         join.member.node)
                dead.add(join.member.incarnation)
                with self._cond:
                    self._dead.add(join.member.incarnation)
        members = complete_round(self._node, target, joins=joins, dead=dead, expected=expected,
                                 previous=previous, min_nodes=self._min, max_nodes=self._max)
        if members is not None:
            log.debug("round %d can complete: %s, expected %s",
                      target, [m.node for m in members], sorted(expected))
        return members

    def _commit(self, target: int, members: tuple[Member, ...]) -> bool:
        """Write round ``target`` if nobody changed the round record meanwhile."""
        record = RoundRecord(target, members)
        with self._cond:
            guard = self._round_rev
        ops: list[Put | Delete] = [Put(self._round_key, record.to_json(), self._record_lease_id())]
        if target > 2:  # the store of two rounds ago has no reader left
            ops.append(Delete(self._store_prefix(target - 2), prefix=True))
        try:
            result = self._client.txn([Compare(self._round_key, "mod", "==", guard)], ops)
        except EtcdError as exc:
            log.warning("cannot write round %d (%s); re-evaluating", target, exc)
            return False
        if result.succeeded:
            log.info("round %d complete: %s", target, ", ".join(record.nodes()))
            with self._cond:
                if result.revision > self._round_rev:
                    self._round, self._round_rev = record, result.revision
        return result.succeeded

    def _record_lease_id(self) -> int:
        if time.monotonic() > self._record_lease_until:
            self._record_lease = self._client.grant_lease(RECORD_TTL_S)
            self._record_lease_until = time.monotonic() + RECORD_TTL_S / 2
        return self._record_lease

    def _put_record(self, key: str, value: bytes) -> None:
        try:
            self._client.put(key, value, lease=self._record_lease_id())
        except EtcdError as exc:
            raise RendezvousConnectionError(f"job {self._run_id}: {exc}") from exc

    def _store_prefix(self, round_: int) -> str:
        return self._keys.round_store_prefix(self._run_id, round_)

    def _round_info(self, mine: RoundRecord | None) -> RendezvousInfo:
        assert mine is not None
        rank = mine.nodes().index(self._node)
        store: Store = EtcdV3Store(
            self._client, self._store_prefix(mine.round), timeout=self._store_timeout
        )
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._addr)
        peers = {m.node: (m.addr, m.port) for m in mine.members if m.node != self._node}
        assert self._monitor is not None
        self._monitor.watch(peers)
        log.info("round %d: rank %d of %d", mine.round, rank, len(mine.members))
        return RendezvousInfo(store, rank, len(mine.members), bootstrap)

    def _on_peer_lost(self, node: str) -> None:
        with self._cond:
            if self._mine is None:
                return
            for member in self._mine.members:
                if member.node == node:
                    self._dead.add(member.incarnation)
                    self._lost.add(node)
            self._cond.notify_all()

    def _on_event(self, event: WatchEvent) -> None:
        with self._cond:
            try:
                self._apply(event)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring a malformed rendezvous record %s: %s", event.key, exc)
            self._cond.notify_all()

    def _apply(self, event: WatchEvent) -> None:
        key = event.key
        if key == self._round_key:
            if event.kind == "put" and event.mod_revision >= self._round_rev:
                self._round = RoundRecord.from_json(event.value)
                self._round_rev = event.mod_revision
            elif event.kind == "delete":
                self._round, self._round_rev = None, 0
            return
        if key == self._closed_key:
            self._closed = event.kind == "put"
            return
        node = Keys.id_under(self._joins_prefix, key)
        if node is None:
            return
        members = {m.node: m for m in self._mine.members} if self._mine else {}
        if event.kind == "delete":
            self._joins.pop(node, None)
            if node in members and node != self._node:
                # Its lease ended (hung, cut off, gone, or it could not reach
                # etcd) or it left: this round is over. Not "dead": a runner
                # that lost its lease to an etcd outage puts the same record
                # back, and must then be waited for again.
                self._lost.add(node)
            return
        join = JoinRecord.from_json(event.value)
        if join.member.node != node:
            raise ValueError(f"record of node {join.member.node!r} under key of {node!r}")
        self._joins[node] = join
        member = members.get(node)
        replaced = member is not None and member.incarnation != join.member.incarnation
        if member is not None and replaced and node != self._node:
            self._lost.add(node)  # a new runner there: the member's workers are gone
            self._dead.add(member.incarnation)
