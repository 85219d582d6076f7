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

So a round completes the moment a member is known lost, leaves, or a node
waits to come in: no timers. One member writes rounds, the *leader*
(:mod:`rendezvous.elastic.assigned_leader`: fenced by its key's create revision); the
others read O(1) small records (:mod:`rendezvous.elastic.assigned_state`). Who
writes, watches and fences which key under ``P/rdzv/<job>/assigned/``: the table in
docs/architecture.md ("One writer per round"); the keys in :mod:`rendezvous.keys`. In
short: join records (``m/join/<node>``, under each runner's lease) and lost marks
(``m/lost/<node>``) are watched by the leader only; ``ctl/`` (state, closed)
by every member; ``leader`` by the leader and its deputy; ``rank/<node>`` is read by its
node only when the state names it (its ring changed) or for its first round, the others
derive it from their last (:func:`~rendezvous.elastic.assigned_state.derive_rank`);
``roster/`` by a leader taking over; and each round gets a fresh c10d store at
``P/rdzv/<job>/store/<round>/`` (:class:`~rendezvous.elastic.store.EtcdV3Store`).

Liveness is a ring: each member holds a connection to :data:`RING_K` successors
in rank order (kept across rounds), and marks a peer whose connection dropped
``m/lost/<peer>`` (deleting the leader key too if the peer led): the leader
forms the next round at once. A hung or cut-off member is caught by its lease,
whose end deletes its join record (and its leader key). When the leader key is
gone the deputy named in the state (which watches it) takes it at once; a member
that waits ``lease_ttl_s`` for a round reads the key and takes it if it is free.

A round's members learn that it is obsolete through :meth:`pending_change`
(:func:`rendezvous.elastic.assigned_state.member_change`): the next round was
formed (lost, leaving or waiting, with the nodes; *superseded* if without this
node), a change is pending that cannot form a round yet, or a ring peer of
this node died. The runner (:mod:`agent.runner.elastic`) asks on every monitor
tick; it costs no etcd call.

An etcd outage does not break a running round: leases survive a restarted
etcd, and a runner that lost its lease while etcd was unreachable puts its
record back under a new lease once etcd answers (the leader then forms a round
without it, and one with it again).

A join record is *fenced* by the node's assignment (``fence``): a runner
whose assignment is gone or rewritten cannot join again
(:class:`~rendezvous.elastic.assigned_join.AssignmentWithdrawnError`; why, in
:mod:`rendezvous.elastic.assigned_join`).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.distributed import get_free_port

from rendezvous.elastic.assigned_join import AssignmentWithdrawnError, JoinRecordKeeper
from rendezvous.elastic.assigned_leader import RECORD_TTL_S, RoundLeader, mark_lost, read_round
from rendezvous.elastic.assigned_rounds import WAITING, Change, Fence, Member
from rendezvous.elastic.assigned_state import (
    RING_K,
    Peer,
    RankRecord,
    StateRecord,
    derive_rank,
    holds_lost,
    member_change,
    next_roster,
)
from rendezvous.elastic.liveness import LivenessServer, PeerMonitor
from rendezvous.elastic.store import EtcdV3Store
from rendezvous.errors import EtcdError
from rendezvous.etcd import Compare, EtcdClient, Put, WatchEvent
from rendezvous.keys import Keys, validate_id
from rendezvous.lease import LeaseCache
from rendezvous.watch import PrefixWatcher

log = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "RING_K", "AssignedRendezvousHandler", "AssignmentWithdrawnError"]

BACKEND_NAME = "tidal-assigned"
# While waiting, the state is looked at on every watch event and at least this often.
REEVALUATE_S = 0.25
# How long a member waits for a round without the peers it saw die (holds_lost).
LOST_ROUND_WAIT_S = 5.0


MASTER_KEY = "TIDAL_MASTER"  # the round store's key of rank 0's {"addr", "port"}


def _store_info(rank: int, store: EtcdV3Store, addr: str, after: int) -> RendezvousStoreInfo:
    """What torch's ``RendezvousStoreInfo.build`` does (rank 0 puts its address and a free
    port in the round's store, every node reads them), in one write and one read of one
    key: rank 0 puts ``MASTER_KEY`` (torch's ``MASTER_ADDR`` and ``MASTER_PORT`` too, in the
    same transaction, for whoever reads those), the others read it (and, when they come
    first, wait for it on one watch whose event carries the value). Two sets and two gets,
    each get waiting on a watch of its own, cost every member of a large job about 300
    bytes from etcd and two watch events a round. ``after``: the revision the round's
    state was written at (0: unknown); rank 0 puts the key after it, so the others watch
    from there at once instead of reading first (:meth:`EtcdV3Store.get_after`).
    """
    if rank == 0:
        port: int = get_free_port()  # type: ignore[no-untyped-call]
        store.multi_set(
            [MASTER_KEY, RendezvousStoreInfo.MASTER_ADDR_KEY,
             RendezvousStoreInfo.MASTER_PORT_KEY],
            [json.dumps({"addr": addr, "port": port}), addr, str(port)],
        )
        return RendezvousStoreInfo(master_addr=addr, master_port=port)
    master = json.loads(store.get_after(MASTER_KEY, after))
    return RendezvousStoreInfo(master_addr=str(master["addr"]), master_port=int(master["port"]))


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
            at most ``assigned_wait_s``. Called by the leader only. None:
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
        self._lease_ttl_s = lease_ttl_s
        self._join_timeout_s = join_timeout_s
        self._store_timeout = datetime.timedelta(seconds=store_timeout_s)
        self._state_key = self._keys.assigned_state(run_id)
        self._leader_key = self._keys.assigned_leader(run_id)
        self._closed_key = self._keys.assigned_closed(run_id)

        self._cond = threading.Condition()
        self._state: StateRecord | None = None
        self._leader: tuple[str, int] | None = None  # (node, create revision) of the leader key
        self._leader_gone_at = time.monotonic()
        self._progress_at = time.monotonic()  # when the last new round's state came
        self._round_rev = (0, 0)  # (round, the revision its state was written at; 0: unknown)
        self._closed = False
        self._mine = 0  # the number of the round this node is in; 0: none
        self._rank: RankRecord | None = None  # this node's record in that round
        self._latest: RankRecord | None = None  # its record in the state's round, if in it
        self._checked = 0  # the state round whose rank record was read
        self._reading = 0  # the state round whose rank record a thread is reading now
        self._lost: set[str] = set()  # ring peers seen dead since this node's round formed
        self._ring: dict[str, Peer] = {}
        self._roster: tuple[int, frozenset[str]] = (0, frozenset())
        self._entered: StateRecord | None = None  # the state of this node's round
        self._incarnation = uuid.uuid4().hex[:12]

        self._server: LivenessServer | None = None
        self._monitor: PeerMonitor | None = None
        self._watcher: PrefixWatcher | None = None
        self._leader_watcher: PrefixWatcher | None = None  # the leader and deputy only
        self._leading: RoundLeader | None = None
        self._seat: threading.Thread | None = None
        self._stopped = threading.Event()
        self._join = JoinRecordKeeper(
            client, self._keys, run_id=self._run_id, node_id=self._node,
            lease_ttl_s=lease_ttl_s, join_timeout_s=join_timeout_s, fence=fence,
            stopped=self._stopped,
        )
        self._records = LeaseCache(client, RECORD_TTL_S)

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
        try:
            self._records.with_lease(lambda lease: self._client.put(self._closed_key, b"1",
                                                                    lease=lease))
        except EtcdError as exc:
            raise RendezvousConnectionError(f"job {self._run_id}: {exc}") from exc

    def num_nodes_waiting(self) -> int:
        """Nodes (newcomers, or members that re-joined) that want a later round."""
        change = self.pending_change()
        return len(change.nodes) if change is not None and change.kind == WAITING else 0

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
            mine = self._mine
        deadline = time.monotonic() + self._join_timeout_s
        lost_deadline = time.monotonic() + LOST_ROUND_WAIT_S
        while True:
            with self._cond:
                if self._closed:
                    raise RendezvousClosedError(f"the rendezvous of job {self._run_id} is closed")
                if self._stopped.is_set():
                    raise RendezvousClosedError("this node left the rendezvous")
                state, checked, latest = self._state, self._checked, self._latest
            newer = state is not None and state.round > mine
            if newer and checked < state.round:  # type: ignore[union-attr]
                self._check_latest(state, wait=True)  # type: ignore[arg-type]
                continue
            if newer and latest is not None and latest.round == state.round:  # type: ignore[union-attr]
                with self._cond:
                    stale = holds_lost(latest, self._lost)
                if not stale or time.monotonic() > lost_deadline:
                    break  # (after LOST_ROUND_WAIT_S, the group's own failure tells)
                with self._cond:
                    self._cond.wait(REEVALUATE_S)  # the leader drops them in the next
                continue
            want = (state.round if state is not None else 0) + 1
            if self._join.wanted < want:
                self._join.put(want)  # a newcomer, a member not in the latest, or a restart
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"job {self._run_id}: round {want} did not gather min_nodes={self._min} "
                    f"within {self._join_timeout_s:.0f} s"
                )
            with self._cond:
                self._cond.wait(REEVALUATE_S)
        assert state is not None and latest is not None
        return self._enter(state, latest)

    # what the runner asks on every tick ------------------------------------

    def pending_change(self) -> Change | None:
        """Why this node's round is obsolete, or None while it holds
        (:func:`rendezvous.elastic.assigned_state.member_change`)."""
        with self._cond:
            state = self._state
            in_latest = (state is not None and self._checked == state.round
                         and self._latest is not None and self._latest.round == state.round)
            if state is not None and state.round > self._mine and self._checked < state.round:
                return None  # its rank record is being read
            return member_change(self._node, self._mine, state, in_latest, self._lost)

    def set_bounds(self, min_nodes: int, max_nodes: int) -> None:
        """Take new bounds (a PATCH rewrote the assignment in place): later rounds use them.

        A larger ``max_nodes`` gives a waiting newcomer room at once (the leader
        uses its own bounds); the current round is not touched otherwise.
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
        gone = set(self._lost)
        with self._cond:
            state = self._state
        if state is not None:
            for change in (state.why if state.round > self._mine else None, state.pending):
                if change is not None and change.kind != WAITING:
                    gone |= change.nodes
        return self.participants() - gone - {self._node}

    def current_round(self) -> int:
        """The number of this node's current (or last) round; 0 before its first."""
        with self._cond:
            return self._mine

    def participants(self) -> frozenset[str]:
        """The members of this node's current (or last) round: the last round's and the
        change it formed for (:func:`~rendezvous.elastic.assigned_state.next_roster`), else
        read from the rank records (O(N), the first round or when that does not add up)."""
        with self._cond:
            mine, (cached, roster), entered = self._mine, self._roster, self._entered
        if mine == 0:
            return frozenset()
        if cached == mine:
            return roster
        derived = next_roster(roster, cached, entered)
        if derived is not None and self._node in derived:
            with self._cond:
                self._roster = (mine, derived)
            return derived
        try:
            nodes = {m.node for m in read_round(self._client, self._keys, self._run_id, mine)}
        except EtcdError as exc:
            log.warning("cannot read the members of round %d: %s", mine, exc)
            return roster | {self._node}
        with self._cond:
            self._roster = (mine, frozenset(nodes))
        return frozenset(nodes)

    def is_leader(self) -> bool:
        """Whether this node writes the rounds now."""
        leading = self._leading
        return leading is not None and leading.leading

    def announce_leaving(self) -> bool:
        """Say that this node is on its way out (a planned leave), without leaving yet.

        The join record is put again with the same round and incarnation and
        ``leaving`` set: the leader forms the next round without this node (the
        others see :meth:`pending_change` kind ``"leaving"``) while its workers
        go on; :meth:`leave` follows once they are done. The put is not fenced
        by the assignment (which a planned leave has usually removed already):
        it only takes this node out of rounds, and holds only while the record
        is still there under this runner's lease.

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
        with self._cond:
            self._cond.notify_all()
        if self._seat is not None:  # before the leader: the seat may be starting one
            self._seat.join(timeout=5)
        if self._leading is not None:
            self._leading.stop()
        self._join.close()  # revokes the lease: deletes the join record (and the leader key)
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
            self._client, self._keys.assigned_ctl_prefix(self._run_id), on_event=self._on_event,
            name=f"rendezvous {self._run_id} {self._node}",
        ).start()
        if not self._watcher.wait_synced(self._join_timeout_s):
            raise RendezvousConnectionError(f"job {self._run_id}: cannot read the rendezvous")
        self._join.start(Member(self._node, self._addr, self._server.port, self._incarnation))
        self._seat = threading.Thread(target=self._keep_seat, name=f"rdzv-seat {self._node}",
                                      daemon=True)
        self._seat.start()

    def _check_latest(self, state: StateRecord, *, wait: bool = False) -> None:
        """Read this node's rank record for ``state``'s round (once per round).

        Three threads may find it unread at once (the watch's on the state event, the
        round's waiter, the seat): one reads it, the others return (``wait``: once it
        is read, or after REEVALUATE_S), so a round costs each node one read, not three.
        """
        with self._cond:
            if self._checked >= state.round:
                return
            previous = self._latest if self._checked == state.round - 1 else None
            derived, record = (False, None) if previous is None else derive_rank(previous, state)
            if self._join.wanted == 0:
                # This incarnation has put no join record yet (``wanted`` is set before
                # the put): no round can hold it, nothing to read.
                derived, record = True, None
            if derived:  # no read: the leader said this node's record follows from its last
                self._checked, self._latest = state.round, record
                self._cond.notify_all()
                return
            if self._reading >= state.round:
                if wait:
                    self._cond.wait(REEVALUATE_S)
                return
            self._reading = state.round
        try:
            kv = self._client.get(self._keys.assigned_rank(self._run_id, self._node))
            rank = RankRecord.from_json(kv.value) if kv is not None else None
        except EtcdError as exc:
            log.warning("cannot read this node's rank (%s); retrying", exc)
            self._done_reading(state.round)
            self._stopped.wait(0.1)
            return
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring a malformed rank record: %s", exc)
            rank = None
        except BaseException:
            self._done_reading(state.round)
            raise
        with self._cond:
            self._done_reading(state.round)
            if state.round >= self._checked:
                self._checked = state.round
                mine = rank is not None and rank.round == state.round and (
                    rank.member.incarnation == self._incarnation)
                self._latest = rank if mine else None
            self._cond.notify_all()

    def _done_reading(self, round_: int) -> None:
        with self._cond:
            if self._reading == round_:
                self._reading = 0
            self._cond.notify_all()

    def _enter(self, state: StateRecord, rank: RankRecord) -> RendezvousInfo:
        with self._cond:
            self._mine, self._rank, self._entered = state.round, rank, state
            self._lost.clear()
            self._ring = {p.member.node: p for p in rank.ring}
        store = EtcdV3Store(
            self._client, self._keys.round_store_prefix(self._run_id, state.round),
            timeout=self._store_timeout,
        )
        with self._cond:
            number, revision = self._round_rev
        bootstrap = _store_info(rank.rank, store, self._addr,
                                revision if number == state.round else 0)
        assert self._monitor is not None
        self._monitor.watch({p.member.node: (p.member.addr, p.member.port) for p in rank.ring})
        log.info("round %d: rank %d of %d", state.round, rank.rank, state.world)
        return RendezvousInfo(store, rank.rank, state.world, bootstrap)

    def _on_peer_lost(self, node: str) -> None:
        """A ring peer's liveness socket closed: it died. Say so to the leader."""
        with self._cond:
            peer = self._ring.get(node)
            state = self._state
            if peer is None:
                return
            self._lost.add(node)
            self._cond.notify_all()
        led = state is not None and state.leader == node
        threading.Thread(target=mark_lost, args=(self._client, self._keys, self._run_id,
                                                 self._records, peer), kwargs={"led": led},
                         daemon=True, name=f"rdzv-mark {self._node}").start()

    def _on_event(self, event: WatchEvent) -> None:
        with self._cond:
            try:
                self._apply(event)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring a malformed rendezvous record %s: %s", event.key, exc)
            self._cond.notify_all()
            state = self._state
            check = state is not None and state.round > max(self._mine, self._checked)
        if check:
            assert state is not None
            self._check_latest(state)

    def _apply(self, event: WatchEvent) -> None:
        if event.key == self._state_key:
            if event.kind == "put":
                state = StateRecord.from_json(event.value)
                if self._state is None or state.round > self._state.round:
                    self._progress_at = time.monotonic()
                    # The revision the round's state was written at, if this is that
                    # write (a pending change is put later, in the same round): the round
                    # store's key comes after it (_store_info watches from it).
                    self._round_rev = (state.round, event.mod_revision
                                       if state.pending is None else 0)
                if self._state is None or state.round >= self._state.round:
                    self._state = state
            return
        if event.key == self._closed_key:
            self._closed = event.kind == "put"

    def _on_leader_event(self, event: WatchEvent) -> None:
        with self._cond:
            if event.key != self._leader_key:
                return
            if event.kind == "put":
                self._leader = (event.value.decode(), event.create_revision)
            else:
                self._leader, self._leader_gone_at = None, time.monotonic()
            self._cond.notify_all()

    def _watch_leader(self, state: StateRecord | None) -> bool:
        """Watch the leader key (outside ``ctl/``) while this node leads, is
        the deputy, or there is no state yet; stop otherwise. Returns whether this node
        knows the leader key now (watching, and synced)."""
        want = (state is None or self._node in (state.leader, state.deputy)
                or self._leading is not None)
        watcher = self._leader_watcher
        if want and watcher is None:
            self._leader_watcher = watcher = PrefixWatcher(
                self._client, self._leader_key, on_event=self._on_leader_event,
                name=f"rdzv-leader-key {self._node}",
            ).start()
        elif not want and watcher is not None:
            self._leader_watcher = None
            watcher.stop(timeout=5)
            with self._cond:
                self._leader = None
            return False
        return watcher is not None and watcher.synced

    def _needs_leader(self, state: StateRecord | None) -> bool:
        """Whether this node (not watching the leader key) waits for a round that only a
        leader can form: it asked for a later round, or saw a ring peer die."""
        number = state.round if state is not None else 0
        with self._cond:
            lost = bool(self._lost) and number <= self._mine
        return self._join.wanted > number or lost

    def _keep_seat(self) -> None:
        """Lead while this node holds the leader key; take it when it is free and this node
        is the deputy (or nobody leads yet, or nobody took it for ``lease_ttl_s``).

        Only the leader and its deputy watch the leader key (and every member before the
        first state): a change of leader costs the others nothing. A member that waits
        for a round (it asked for one, or a ring peer died) and sees none come for
        ``lease_ttl_s`` reads the key, and takes it if it is free: the deputy died too.
        """
        while not self._stopped.is_set():
            with self._cond:
                self._cond.wait(REEVALUATE_S)
                state = self._state
                unread = state is not None and state.round > max(self._mine, self._checked)
            if unread:  # the watch's read of this node's rank record failed: again
                assert state is not None
                self._check_latest(state)
            if self._stopped.is_set():
                break
            knows = self._watch_leader(state)
            with self._cond:
                leader, gone_at = self._leader, self._leader_gone_at
            leading = self._leading
            if leading is not None and (not leading.leading or (knows and (
                    leader is None or leader[1] != leading.create_revision))):
                leading.stop()
                self._leading = leading = None
            if knows:
                if leader is None and (
                    state is None or self._node in (state.leader, state.deputy)
                    or time.monotonic() - gone_at > self._campaign_after_s()
                ):
                    self._campaign()
                    with self._cond:  # the others try again after another grace, not a herd
                        self._leader_gone_at = time.monotonic()
                elif leader is not None and leader[0] == self._node and leading is None:
                    self._lead(leader[1])
            elif (self._needs_leader(state)
                  and time.monotonic() - self._progress_at > self._campaign_after_s()):
                with self._cond:
                    self._progress_at = time.monotonic()  # once per grace, not a herd
                try:
                    free = self._client.get(self._leader_key) is None
                except EtcdError as exc:
                    log.warning("cannot read the round leader's key: %s", exc)
                    continue
                if free:
                    self._campaign()
        watcher, self._leader_watcher = self._leader_watcher, None
        if watcher is not None:
            watcher.stop(timeout=5)

    def _campaign_after_s(self) -> float:
        """How long a member that is not the deputy leaves the leader key free: a
        lease's TTL (the deputy may be dead too), staggered by rank."""
        rank = self._rank.rank if self._rank is not None else 0
        return self._lease_ttl_s + 0.25 * (rank % 16)

    def _campaign(self) -> None:
        lease = self._join.lease_id
        if lease is None:
            return
        try:
            result = self._client.txn([Compare(self._leader_key, "create", "==", 0)],
                                      [Put(self._leader_key, self._node.encode(), lease)])
        except EtcdError as exc:
            log.warning("cannot take the round leader's key: %s", exc)
            return
        if result.succeeded:
            self._lead(result.revision)

    def _lead(self, create_revision: int) -> None:
        if self._leading is not None or self._stopped.is_set():
            return
        self._leading = RoundLeader(
            self._client, self._keys, run_id=self._run_id, node=self._node,
            create_revision=create_revision, bounds=lambda: (self._min, self._max),
            expected=None if self._expected_nodes is None else (lambda: self._read_expected()),
            assigned_wait_s=self._assigned_wait_s, records=self._records,
        ).start()

    def _read_expected(self) -> Collection[str]:
        assert self._expected_nodes is not None
        return self._expected_nodes()



