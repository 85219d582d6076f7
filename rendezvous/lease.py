"""Keep etcd leases alive, a process's on one stream (one per 32 leases), and say when one
is lost.

:class:`LeaseKeeper` grants a lease and keeps it alive until closed or lost.
The keep-alives of a process's leases go through one
:class:`KeepAlives` per etcd cluster (and one more for each further
:data:`LEASES_PER_STREAM` leases): one LeaseKeepAlive stream
(:class:`~rendezvous.etcd.keepalive.KeepAliveStream`) on an etcd client of its
own (its own gRPC channel, authenticated as the process's client is), one
thread that sends each lease's keep-alive every ``ttl / 3`` seconds and one
that reads the answers. Neither thread does anything else: a process whose
other threads are busy forming rounds, handling watches or running thousands
of simulated members cannot starve its keep-alives behind that work (#24). A
process holding a thousand leases sends a thousand small messages on 32 streams,
instead of keeping a thousand threads that each open a call; not on one, because etcd
answers one stream's keep-alives one at a time, each behind its apply loop.

Each lease rides out a transient etcd outage, but only for as long as it can
still be alive: the keeper keeps its own deadline, on its own monotonic clock,
of when the lease runs out if no further keep-alive is answered. Once that
deadline passes, or etcd answers that the lease no longer exists, the lease is
*lost*: the keeper calls ``on_lost`` once (on a thread of its own, so that an
owner's reaction never delays another lease's keep-alive) and stops. It never
re-grants by itself; the owner (a node registration, an election candidate, a
join record) decides what a lost lease means for it.

With several etcd endpoints, a keep-alive waits at most one keep-alive interval
for its answer (and never past its lease's deadline). An etcd member cut off
from the network swallows keep-alives instead of refusing them; waiting on it
until the lease runs out would lose the lease with two healthy members a
failover away. So an unanswered keep-alive ends the stream: its member is
quarantined, and the keep-alives are sent again on a new stream to another
member, each later failure waiting twice as long in case etcd is slow rather
than gone. A stream that fails (etcd restarting) is opened again after 0.1 s,
then up to 1 s apart. Sending a keep-alive again is safe whatever became of the
first: it only restarts the TTL, and one delivered late (after the keeper gave
up) keeps the lease on the server for at most one more TTL, as an etcd restart
does, which owners handle already (see below).

Why the keeper's own clock and not etcd's word: a keeper cut off from etcd
cannot ask. And a restarted etcd gives every lease a full TTL again, so a lease
the keeper gave up on may linger on the server for one more TTL; owners that
re-register must therefore accept a key still held by their *previous* lease
(see :mod:`rendezvous.registry`). A lease alone does not fence a paused holder:
writes that matter compare on the lease or on a revision (see
:mod:`rendezvous.election`).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar

from rendezvous.errors import EtcdError, LeaseExpiredError
from rendezvous.etcd import EtcdClient, EtcdConfig, KeepAliveStream, create_client

log = logging.getLogger(__name__)

# etcd raises shorter TTLs to about 2 s anyway; refuse them so that the
# keeper's deadline matches what the caller believes.
MIN_TTL_S = 2
_FIRST_RETRY_S = 0.1
_MAX_RETRY_S = 1.0
_MAX_PATIENCE = 8  # an unanswered keep-alive's wait doubles after each failure, up to 8x
_COALESCE_S = 0.05  # keep-alives due this close together leave in one pass
# Leases a stream carries at most; a process with more opens another (a hub each). etcd
# answers a stream's keep-alives one after the other, and etcd 3.4's leader first waits,
# for each, until it has applied what it committed: behind a busy apply loop a burst of 128
# on one stream waited up to 6.6 s for its last answers (the 1,024-member soak of #24,
# docs/benchmarks.md), past the keepers' deadlines.
LEASES_PER_STREAM = 32


class KeepAliveTrace:
    """When each keep-alive of this process was due, sent and answered, and each loss:
    where a lease's seconds went (#24's soak). Off unless a benchmark sets
    :attr:`KeepAlives.trace`; the hub appends under its own lock (a few tuples per
    keep-alive, nothing else).

    ``sends``: ``(lease, due, sent)``; ``answers``: ``(lease, sent, answered, ttl)``;
    ``wakes``: ``(meant, woke)`` of the sending thread's timed sleeps; ``losses``:
    ``(lease, declared, expires_at, in_flight_since or None, last_sent, last_answered)``.
    Times are ``time.monotonic()``.
    """

    def __init__(self) -> None:
        self.sends: list[tuple[int, float, float]] = []
        self.answers: list[tuple[int, float, float, int]] = []
        self.wakes: list[tuple[float, float]] = []
        self.losses: list[tuple[int, float, float, float | None, float, float]] = []
        self.last_sent: dict[int, float] = {}
        self.last_answered: dict[int, float] = {}


def _cluster_of(config: EtcdConfig) -> str:
    """What makes two clients' keep-alives shareable: the same members and credentials."""
    secret = config.password.get_secret_value() if config.password is not None else ""
    return repr((sorted(config.endpoints), config.ca_cert, config.cert_cert, config.cert_key,
                 config.user, secret))


class KeepAlives:
    """The keep-alives of up to :data:`LEASES_PER_STREAM` leases of this process on one
    etcd cluster.

    One per process and cluster (endpoints and credentials), and another for each
    further :data:`LEASES_PER_STREAM` leases (a process of tidal holds a few), made by
    the first :class:`LeaseKeeper` that needs it and ended when the last one closes.
    Threads: ``keep-alive`` (opens the stream, sends what is due, declares
    losses) and ``keep-alive answers`` (reads the stream). Its etcd client is
    its own, built from the configuration of the first keeper's client, so the
    keep-alives never queue behind the process's other calls on a channel.
    """

    _hubs: ClassVar[dict[str, KeepAlives]] = {}
    _hubs_lock: ClassVar[threading.Lock] = threading.Lock()
    trace: ClassVar[KeepAliveTrace | None] = None  # a benchmark's record; None: off

    def __init__(self, config: EtcdConfig, cluster: str) -> None:
        self._config = config
        self._cluster = cluster
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._keepers: dict[int, LeaseKeeper] = {}
        self._stopping = False
        self._client: EtcdClient | None = None
        self._stream: KeepAliveStream | None = None
        self._broken = False  # the current stream failed: open another
        self._patience = 1  # multiplies each keeper's call timeout after failures
        self._retry_s = _FIRST_RETRY_S
        self._tried = False  # a stream was opened (or tried) before
        self._thread = threading.Thread(target=self._run, name="keep-alive", daemon=True)

    # registration ---------------------------------------------------------------

    @classmethod
    def add(cls, keeper: LeaseKeeper, config: EtcdConfig) -> None:
        """Keep ``keeper``'s lease alive from now on (its deadline and schedule set)."""
        cluster = _cluster_of(config)
        with cls._hubs_lock:
            hub = cls._hub_with_room(config, cluster)
            with hub._cond:
                hub._keepers[keeper.lease_id] = keeper
                keeper._hub = hub
                hub._cond.notify()

    @classmethod
    def _hub_with_room(cls, config: EtcdConfig, cluster: str) -> KeepAlives:
        """The first of this process's hubs for ``cluster`` with room, or a new one
        (called under ``_hubs_lock``)."""
        for index in itertools.count():
            key = f"{cluster}#{index}"
            hub = cls._hubs.get(key)
            # None yet, one inherited through fork (its threads did not come along),
            # or one ending after a failure of its thread: start another.
            if hub is None or hub._pid != os.getpid() or hub._stopping:
                hub = cls._hubs[key] = KeepAlives(config, key)
                hub._thread.start()
                return hub
            with hub._cond:
                if len(hub._keepers) < LEASES_PER_STREAM:
                    return hub
        raise AssertionError("unreachable")

    def remove(self, keeper: LeaseKeeper) -> None:
        """Stop keeping ``keeper``'s lease alive; the last one removed ends this hub."""
        with self._hubs_lock, self._cond:
            if self._keepers.get(keeper.lease_id) is keeper:
                del self._keepers[keeper.lease_id]
            if not self._keepers and not self._stopping:
                self._stopping = True
                if self._hubs.get(self._cluster) is self:
                    del self._hubs[self._cluster]
            self._cond.notify()

    @classmethod
    def held(cls) -> set[int]:
        """The leases this process keeps alive now, on every cluster."""
        with cls._hubs_lock:
            hubs = list(cls._hubs.values())
        held: set[int] = set()
        for hub in hubs:
            with hub._cond:
                held.update(hub._keepers)
        return held

    # the sending thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                if self._connected():
                    self._pass()
        except Exception:  # a bug here must not pass silently: every lease runs down
            log.exception("the keep-alive thread failed; leases will be reported lost")
        finally:
            self._end()

    def _connected(self) -> bool:
        """A live stream, opened (with its reader) if there is none; False: not now.

        Every opening after the first follows a failure (a stream that broke
        or stalled, or an opening that failed), so it waits ``_retry_s`` first,
        which doubles up to 1 s and returns to 0.1 s with the next answer.
        """
        with self._cond:
            if self._stream is not None and not self._broken:
                return True
            old, self._stream, self._broken = self._stream, None, False
            for keeper in self._keepers.values():
                keeper._sent_at = None  # what was in flight is sent again on the next stream
            retry = self._retry_s if self._tried else 0.0
            self._tried = True
        if old is not None:
            old.cancel()
        if retry:
            self._pause(retry)
            self._retry_s = min(2 * retry, _MAX_RETRY_S)
        self._declare_overdue(time.monotonic())
        try:
            if self._client is None:
                self._client = create_client(self._config, probe=False)
            stream = self._client.lease_keepalive()
        except EtcdError as exc:
            log.info("cannot open the lease keep-alive stream (%s); retrying", exc)
            return False
        with self._cond:
            self._stream = stream
        threading.Thread(target=self._read, args=(stream,), name="keep-alive answers",
                         daemon=True).start()
        return True

    def _pass(self) -> None:
        """Send what is due, declare what ran out, then sleep until the next thing is due."""
        now = time.monotonic()
        due: list[int] = []
        wake = now + 1.0
        stalled = False
        with self._cond:
            for lease_id, keeper in self._keepers.items():
                wake = min(wake, keeper._expires_at)
                if keeper._sent_at is not None:
                    answer_by = keeper._sent_at + keeper._call_timeout * self._patience
                    stalled = stalled or now >= answer_by
                    wake = min(wake, answer_by)
                elif now + _COALESCE_S >= keeper._next_due:
                    keeper._sent_at = now
                    due.append(lease_id)
                    if (trace := KeepAlives.trace) is not None:
                        trace.sends.append((lease_id, keeper._next_due, now))
                        trace.last_sent[lease_id] = now
                else:
                    wake = min(wake, keeper._next_due)
            stream = self._stream
        self._declare_overdue(now)
        if stream is None:
            return
        if stalled:
            # The member swallowed a keep-alive: end the stream (blaming the
            # member) and send again on another, waiting longer next time.
            with self._cond:
                self._broken = True
                self._patience = min(2 * self._patience, _MAX_PATIENCE)
            log.info("a lease keep-alive went unanswered on %s; opening another stream",
                     stream.endpoint)
            stream.cancel(silent=True)
            return
        for lease_id in due:
            stream.send(lease_id)
        self._pause(max(0.0, wake - time.monotonic()))

    def _pause(self, seconds: float) -> None:
        with self._cond:
            if not self._stopping and not self._broken:
                meant = time.monotonic() + seconds
                if not self._cond.wait(seconds) and (trace := KeepAlives.trace) is not None:
                    trace.wakes.append((meant, time.monotonic()))

    def _declare_overdue(self, now: float) -> None:
        with self._cond:
            overdue = [k for k in self._keepers.values() if now >= k._expires_at]
            for keeper in overdue:
                del self._keepers[keeper.lease_id]
                if (trace := KeepAlives.trace) is not None:
                    lease = keeper.lease_id
                    trace.losses.append((lease, now, keeper._expires_at, keeper._sent_at,
                                         trace.last_sent.get(lease, 0.0),
                                         trace.last_answered.get(lease, 0.0)))
        for keeper in overdue:
            keeper._declare_lost(f"no keep-alive succeeded for {keeper.ttl_s} s")

    def _end(self) -> None:
        with self._cond:
            self._stopping = True
            stream, self._stream = self._stream, None
            left = list(self._keepers.values())
            self._keepers.clear()
        with self._hubs_lock:
            if self._hubs.get(self._cluster) is self:
                del self._hubs[self._cluster]
        if stream is not None:
            stream.cancel()
        if self._client is not None:
            self._client.close()
        for keeper in left:  # only after a bug above: say so rather than go quiet
            keeper._declare_lost("the keep-alive thread ended")

    # the reading thread -----------------------------------------------------------

    def _read(self, stream: KeepAliveStream) -> None:
        try:
            for lease_id, ttl in stream:
                self._answered(stream, lease_id, ttl)
        except EtcdError as exc:
            log.info("the lease keep-alive stream failed (%s); opening another", exc)
        with self._cond:
            if stream is self._stream:
                self._broken = True
                self._cond.notify()

    def _answered(self, stream: KeepAliveStream, lease_id: int, ttl: int) -> None:
        with self._cond:
            keeper = self._keepers.get(lease_id)
            if stream is not self._stream or keeper is None or keeper._sent_at is None:
                return  # an answer from an ended stream, or for a closed keeper
            self._patience, self._retry_s = 1, _FIRST_RETRY_S
            if (trace := KeepAlives.trace) is not None:
                answered = time.monotonic()
                trace.answers.append((lease_id, keeper._sent_at, answered, ttl))
                trace.last_answered[lease_id] = answered
            if ttl <= 0:
                del self._keepers[lease_id]
            else:
                # Count the TTL from when the request left: the server
                # restarted it at some moment after that, never before.
                keeper._expires_at = keeper._sent_at + ttl
                keeper._next_due = keeper._sent_at + keeper._interval
                keeper._sent_at = None
                return
        keeper._declare_lost("etcd says it no longer exists")


class LeaseKeeper:
    """Grant a lease and keep it alive until closed or lost.

    Args:
        client: the process's etcd client (grants and revokes the lease; the
            keep-alives go through the process's :class:`KeepAlives` for the
            client's cluster).
        ttl_s: the lease's time to live, in whole seconds (at least 2).
        on_lost: called once, from a thread of its own, when the lease is lost
            (expired, revoked by someone else, or unreachable past its TTL).
            Not called after :meth:`close`. Exceptions are logged.
        name: what the lease is for, in log lines ("node node-3").
        interval_s: time between keep-alives; ``ttl_s / 3`` by default.
        call_timeout_s: how long one keep-alive waits for an answer before it is
            sent again on another stream: by default the interval with several
            etcd endpoints, and the lease's whole TTL with one (there is no
            other member to try, so a shorter wait would only turn a slow
            answer into a retry of the same member). Each retry that follows a
            failure may wait twice as long; no lease waits past its deadline.

    Raises:
        ValueError: ``ttl_s`` is below 2, ``interval_s`` is not below ``ttl_s``
            or ``call_timeout_s`` is not positive.
    """

    def __init__(
        self,
        client: EtcdClient,
        *,
        ttl_s: int,
        on_lost: Callable[[], None] | None = None,
        name: str = "lease",
        interval_s: float | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        if ttl_s < MIN_TTL_S:
            raise ValueError(f"lease ttl_s ({ttl_s}) must be at least {MIN_TTL_S} seconds")
        interval = ttl_s / 3 if interval_s is None else interval_s
        if not 0 < interval < ttl_s:
            raise ValueError(f"keep-alive interval_s ({interval}) must be in (0, ttl_s={ttl_s})")
        if call_timeout_s is not None and call_timeout_s <= 0:
            raise ValueError(f"keep-alive call_timeout_s ({call_timeout_s}) must be positive")
        self._client = client
        self.ttl_s = ttl_s
        self._interval = interval
        if call_timeout_s is None:
            several = len(client.config.endpoints) > 1
            call_timeout_s = interval if several else float(ttl_s)
        self._call_timeout = call_timeout_s
        self._on_lost = on_lost
        self.name = name
        self._lease_id: int | None = None
        # Monotonic times, read and written under the hub's lock:
        self._expires_at = 0.0  # when the lease runs out without a keep-alive answered
        self._next_due = 0.0  # when the next keep-alive leaves
        self._sent_at: float | None = None  # when the one in flight left
        self._hub: KeepAlives | None = None
        self._closed = threading.Event()
        self._lost = threading.Event()

    # lifecycle -------------------------------------------------------------

    def start(self) -> LeaseKeeper:
        """Grant the lease and start keeping it alive.

        Returns:
            ``self``, so that ``keeper = LeaseKeeper(...).start()`` reads well.

        Raises:
            EtcdError: the lease could not be granted (etcd unreachable within
                the client's timeout, out of space, ...).
            RuntimeError: the keeper was already started.
        """
        if self._lease_id is not None:
            raise RuntimeError(f"{self.name}: the lease keeper was already started")
        granted_at = time.monotonic()
        self._lease_id = self._client.grant_lease(self.ttl_s)
        self._expires_at = granted_at + self.ttl_s
        self._next_due = granted_at + self._interval
        KeepAlives.add(self, self._client.config)
        log.debug("%s: lease %x granted, ttl %d s", self.name, self._lease_id, self.ttl_s)
        return self

    @property
    def lease_id(self) -> int:
        """The lease's id.

        Raises:
            RuntimeError: the keeper has not been started.
        """
        if self._lease_id is None:
            raise RuntimeError(f"{self.name}: the lease keeper has not been started")
        return self._lease_id

    @property
    def alive(self) -> bool:
        """True while the lease is held: started, not lost and not closed."""
        return self._lease_id is not None and not self._lost.is_set() and not self._closed.is_set()

    @property
    def lost(self) -> bool:
        """True once the lease was declared lost."""
        return self._lost.is_set()

    def remaining_s(self) -> float:
        """Seconds until the lease runs out by the keeper's clock if no refresh succeeds."""
        return max(0.0, self._expires_at - time.monotonic())

    def wait_lost(self, timeout: float) -> bool:
        """Block until the lease is lost or ``timeout`` seconds pass; True if lost."""
        return self._lost.wait(timeout)

    def close(self, *, revoke: bool = True) -> None:
        """Stop the keep-alives and, by default, revoke the lease (deleting its keys).

        Args:
            revoke: False leaves the lease to expire on its own within its TTL,
                as a crashed process would.

        Revocation is best effort: if etcd cannot be reached the lease simply
        expires. Safe to call more than once.
        """
        already = self._closed.is_set()
        self._closed.set()
        hub = self._hub
        if hub is not None:
            hub.remove(self)
        if already or not revoke or self._lease_id is None or self._lost.is_set():
            return
        try:
            self._client.revoke_lease(self._lease_id)
        except EtcdError as exc:
            log.warning(
                "%s: could not revoke lease %x (%s); it expires within %d s",
                self.name,
                self._lease_id,
                exc,
                self.ttl_s,
            )

    def __enter__(self) -> LeaseKeeper:
        return self.start() if self._lease_id is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _declare_lost(self, why: str) -> None:
        """Mark the lease lost now; tell the owner from a thread of its own."""
        if self._closed.is_set() or self._lost.is_set():
            return
        self._lost.set()
        log.warning("%s: lease %x is lost: %s", self.name, self.lease_id, why)
        if self._on_lost is not None:
            threading.Thread(target=self._tell_owner, name=f"lease lost {self.name}",
                             daemon=True).start()

    def _tell_owner(self) -> None:
        if self._closed.is_set() or self._on_lost is None:
            return
        try:
            self._on_lost()
        except Exception:
            log.exception("%s: the on_lost callback of lease %x raised", self.name, self.lease_id)


class LeaseCache:
    """Hands out a lease for key TTLs, granting a new one when half its TTL is used.

    One lease per process (not per key) keeps the number of leases small;
    rewriting a key with a newer lease extends its life.
    """

    def __init__(self, client: EtcdClient, ttl_s: int) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._lease_id = 0
        self._granted_at = 0.0

    def get(self, timeout_s: float | None = None) -> int:
        """The lease to write under; ``timeout_s`` bounds a grant, if one is due.

        A grant that timed out and is retried may leave a lease nobody uses:
        it holds no key and expires after its TTL, so retrying is harmless.
        """
        with self._lock:
            now = time.monotonic()
            if not self._lease_id or now - self._granted_at > self._ttl_s / 2:
                self._lease_id = self._client.grant_lease(self._ttl_s, timeout_s=timeout_s)
                self._granted_at = now
            return self._lease_id

    def invalidate(self) -> None:
        with self._lock:
            self._lease_id = 0

    def with_lease(self, write: Callable[[int], Any], timeout_s: float | None = None) -> Any:
        """Run ``write(lease_id)``; on a vanished lease, grant a new one and retry once."""
        try:
            return write(self.get(timeout_s))
        except LeaseExpiredError:
            self.invalidate()
            return write(self.get(timeout_s))
