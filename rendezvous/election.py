"""Leader election among coordinator replicas, with fenced writes.

The recipe is etcd's own (``concurrency.Election`` in etcd's client):

* each candidate holds a lease (kept alive by a :class:`~rendezvous.lease.LeaseKeeper`)
  and creates ``keys.election_candidate(name, lease_id)`` under it;
* the leader is the candidate whose key has the lowest ``create_revision``;
* a candidate that is not the leader watches the key of its *predecessor*
  (the candidate just ahead of it) until that key is deleted, then looks again.
  Nobody polls, and a leader's departure wakes exactly one candidate.

A lease does not fence a paused leader: a process stopped for longer than its
TTL wakes up believing it still leads, and may write before its keep-alive
thread notices the lease is gone. Every write a leader makes that matters must
therefore go through :meth:`Election.fenced_txn` (or :meth:`Election.fenced_put`),
which adds, in the same transaction, a guard that the leader's candidate key
still exists with the ``create_revision`` and lease it had when it won. Once the
lease has expired the key is gone and the guard fails: the deposed leader's
write is rejected by etcd itself and :class:`NotLeaderError` is raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from rendezvous.errors import EtcdError, LeaseExpiredError
from rendezvous.etcd import (
    Compare,
    EtcdClient,
    Get,
    KeyValue,
    Put,
    TxnOp,
    TxnResult,
    WatchStream,
)
from rendezvous.lease import LeaseKeeper

log = logging.getLogger(__name__)


class NotLeaderError(EtcdError):
    """This candidate is not (or no longer) the leader; its write was not applied."""


class ElectionTimeoutError(EtcdError, TimeoutError):
    """A campaign did not win within its timeout."""


@dataclass(frozen=True)
class Leader:
    """The current leader as etcd records it."""

    key: str
    value: bytes
    lease: int
    create_revision: int


class Election:
    """One candidate in the election called ``name``.

    Args:
        client: the process's etcd client.
        name: the election's name (an identifier: ``coordinator``).
        value: what this candidate publishes (its address, say), read by
            :meth:`leader`.
        ttl_s: the candidate's lease TTL: how long a dead leader blocks the
            next one.
        on_lost: called once, from the lease keeper's thread, when this
            candidate's lease is lost while it campaigns or leads. Exceptions
            are logged.
    """

    def __init__(
        self,
        client: EtcdClient,
        name: str,
        *,
        value: bytes = b"",
        ttl_s: int = 10,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self.name = name
        self._prefix = client.keys.election_prefix(name)
        self.value = value
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._keeper: LeaseKeeper | None = None
        self._key = ""
        self._create_revision = 0
        self._leader = False
        self._stream: WatchStream | None = None

    # observing -------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this candidate won and its lease is alive by its own clock.

        A paused process can see True for a moment after its lease expired:
        only fenced writes are safe.
        """
        with self._lock:
            keeper = self._keeper
            return self._leader and keeper is not None and keeper.alive

    @property
    def key(self) -> str:
        """This candidate's key (empty before :meth:`campaign`)."""
        return self._key

    @property
    def lease_id(self) -> int:
        """This candidate's lease (0 before :meth:`campaign` or after it ended)."""
        keeper = self._keeper
        return keeper.lease_id if keeper is not None and keeper.alive else 0

    def leader(self) -> Leader | None:
        """The current leader of the election, or None if there is no candidate."""
        kvs, _ = self._client.get_prefix(self._prefix)
        kvs = [kv for kv in kvs if kv.lease]  # see _predecessor
        if not kvs:
            return None
        first = min(kvs, key=lambda kv: kv.create_revision)
        return Leader(first.key, first.value, first.lease, first.create_revision)

    # campaigning ------------------------------------------------------------------

    def campaign(self, timeout: float) -> None:
        """Become a candidate and block until this candidate leads.

        Args:
            timeout: seconds to wait for leadership.

        Raises:
            ElectionTimeoutError: not leader within ``timeout``; the
                candidacy is withdrawn.
            LeaseExpiredError: the candidate's lease was lost while waiting.
            EtcdError: etcd could not be reached to become a candidate.
        """
        deadline = time.monotonic() + timeout
        if self.is_leader:
            return
        self._become_candidate()
        try:
            self._wait_to_lead(deadline)
        except BaseException:
            self.resign()
            raise
        with self._lock:
            self._leader = True
        log.info("election %s: %s is the leader", self.name, self._key)

    def _become_candidate(self) -> None:
        if self._keeper is not None and self._keeper.alive:
            return
        keeper = LeaseKeeper(
            self._client,
            ttl_s=self.ttl_s,
            on_lost=self._lease_lost,
            name=f"election {self.name}",
        ).start()
        key = self._client.keys.election_candidate(self.name, keeper.lease_id)
        try:
            put = self._client.txn(
                [Compare(key, "create", "==", 0)], [Put(key, self.value, lease=keeper.lease_id)]
            )
        except BaseException:
            keeper.close()
            raise
        if not put.succeeded:  # lease ids are unique: this cannot happen
            keeper.close()
            raise EtcdError(f"election {self.name}: candidate key {key} already exists")
        with self._lock:
            self._keeper, self._key, self._create_revision = keeper, key, put.revision

    def _wait_to_lead(self, deadline: float) -> None:
        backoff = 0.1
        while True:
            keeper = self._keeper
            if keeper is None or not keeper.alive:
                raise LeaseExpiredError(
                    f"election {self.name}: the candidate's lease was lost while campaigning"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ElectionTimeoutError(
                    f"election {self.name}: {self._key} did not become leader in time"
                )
            try:
                kvs, revision = self._client.get_prefix(self._prefix)
                predecessor = self._predecessor(kvs)
                if predecessor is None:
                    return
                self._wait_deleted(predecessor.key, revision, deadline)
                backoff = 0.1
            except LeaseExpiredError:
                raise
            except EtcdError as exc:
                log.info("election %s: waiting to lead failed (%s); retrying", self.name, exc)
                time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, 2.0)

    def _predecessor(self, kvs: list[KeyValue]) -> KeyValue | None:
        """The candidate just ahead of this one, or None if this one leads.

        Raises:
            LeaseExpiredError: this candidate's key is gone (its lease expired).
        """
        if not any(kv.key == self._key for kv in kvs):
            raise LeaseExpiredError(
                f"election {self.name}: candidate key {self._key} vanished; its lease expired"
            )
        # A key without a lease is no candidate (only a stray write makes one:
        # candidates always hold a lease); counting it would block everyone forever.
        ahead = [kv for kv in kvs if kv.create_revision < self._create_revision and kv.lease]
        return max(ahead, key=lambda kv: kv.create_revision) if ahead else None

    def _wait_deleted(self, key: str, revision: int, deadline: float) -> None:
        """Return once ``key`` is deleted after ``revision``, or the deadline or a loss passes."""
        stream = self._client.watch(key, prefix=False, start_revision=revision + 1)
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), stream.cancel)
        timer.daemon = True
        with self._lock:
            self._stream = stream
        timer.start()
        try:
            keeper = self._keeper
            if keeper is None or not keeper.alive:  # lost before the stream was published
                return
            for batch in stream:
                if any(ev.kind == "delete" for ev in batch.events):
                    return
        finally:
            timer.cancel()
            stream.cancel()
            with self._lock:
                self._stream = None

    def _lease_lost(self) -> None:
        with self._lock:
            was_leader, self._leader = self._leader, False
            stream = self._stream
        if stream is not None:
            stream.cancel()  # wake a campaign waiting on its predecessor
        log.warning(
            "election %s: %s lost its lease%s",
            self.name,
            self._key,
            " and the leadership" if was_leader else "",
        )
        if self._on_lost is not None:
            self._on_lost()

    def resign(self) -> None:
        """Give up leadership or candidacy: revoke the lease, deleting the candidate key.

        The next candidate takes over at once. Safe to call at any time.
        """
        with self._lock:
            keeper, self._keeper, self._leader = self._keeper, None, False
            stream = self._stream
        if stream is not None:
            stream.cancel()
        if keeper is not None:
            keeper.close(revoke=True)

    close = resign

    def __enter__(self) -> Election:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.resign()

    # fenced writes ----------------------------------------------------------------

    def fenced_txn(
        self,
        compare: Sequence[Compare] = (),
        success: Sequence[TxnOp] = (),
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Run a transaction that etcd applies only while this candidate leads.

        The leader's guard (its candidate key still exists with the create
        revision and lease it won with) is added to ``compare``.

        Args:
            compare: the caller's own guards.
            success: operations if every guard holds.
            failure: operations if a caller's guard fails (not run when the
                leadership guard fails: then :class:`NotLeaderError` is raised).

        Returns:
            The transaction's result; ``succeeded`` is False only when one of
            the caller's guards failed.

        Raises:
            NotLeaderError: this candidate is not the leader, or was deposed
                (its lease expired); nothing was written.
            EtcdError: etcd could not be reached.
        """
        with self._lock:
            leader, key, created = self._leader, self._key, self._create_revision
            keeper = self._keeper
        if not leader or keeper is None:
            raise NotLeaderError(f"election {self.name}: {key or 'this candidate'} is not leader")
        guard = [
            Compare(key, "create", "==", created),
            Compare(key, "lease", "==", keeper.lease_id),
        ]
        result = self._client.txn([*guard, *compare], success, [*failure, Get(key)])
        if result.succeeded:
            return result
        mine = result.gets[-1] if result.gets else ()
        if not mine or mine[0].create_revision != created:
            with self._lock:
                self._leader = False
            raise NotLeaderError(
                f"election {self.name}: {key} was deposed (its lease expired); "
                "the write was rejected"
            )
        return TxnResult(result.succeeded, result.revision, result.gets[:-1])

    def fenced_put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write ``key`` only if this candidate still leads; returns the write's revision.

        Raises:
            NotLeaderError: not the leader, or deposed; nothing was written.
            EtcdError: etcd could not be reached.
        """
        return self.fenced_txn(success=[Put(key, value, lease=lease)]).revision
