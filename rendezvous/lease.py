"""Keep an etcd lease alive from a background thread, and say when it is lost.

pyetcd has no keep-alive of its own: a lease is refreshed by one call at a time.
:class:`LeaseKeeper` grants a lease and refreshes it every ``ttl / 3`` seconds
from a daemon thread. It rides out a transient etcd outage by retrying with a
short backoff, but only for as long as the lease can still be alive: it keeps
its own deadline, on its own monotonic clock, of when the lease runs out if no
further refresh succeeds. Once that deadline passes, or etcd says the lease no
longer exists, the lease is *lost*: the keeper calls ``on_lost`` once and
stops. It never re-grants by itself; the owner (a node registration, an
election candidate) decides what a lost lease means for it.

With several etcd endpoints, each keep-alive waits at most one keep-alive
interval for an answer (and never past the lease's deadline). An etcd member
cut off from the network swallows a keep-alive instead of refusing it;
waiting on it until the lease runs out would lose the lease with two healthy
members a failover away. After a missed deadline the client has quarantined
that member, so the retry goes to another one. Sending a keep-alive again is
safe whatever became of the first: it only restarts the TTL, and one
delivered late (after the keeper gave up) keeps the lease on the server for
at most one more TTL, as an etcd restart does, which owners handle already
(see below).

Why the keeper's own clock and not etcd's word: a keeper cut off from etcd
cannot ask. And a restarted etcd gives every lease a full TTL again, so a lease
the keeper gave up on may linger on the server for one more TTL; owners that
re-register must therefore accept a key still held by their *previous* lease
(see :mod:`rendezvous.registry`). A lease alone does not fence a paused holder:
writes that matter compare on the lease or on a revision (see
:mod:`rendezvous.election`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rendezvous.errors import EtcdError, LeaseExpiredError
from rendezvous.etcd import EtcdClient

log = logging.getLogger(__name__)

# etcd raises shorter TTLs to about 2 s anyway; refuse them so that the
# keeper's deadline matches what the caller believes.
MIN_TTL_S = 2
_FIRST_RETRY_S = 0.1


class LeaseKeeper:
    """Grant a lease and keep it alive until closed or lost.

    Args:
        client: the process's etcd client.
        ttl_s: the lease's time to live, in whole seconds (at least 2).
        on_lost: called once, from the keeper's thread, when the lease is lost
            (expired, revoked by someone else, or unreachable past its TTL).
            Not called after :meth:`close`. Exceptions are logged.
        name: what the lease is for, in log lines ("node node-3").
        interval_s: time between keep-alives; ``ttl_s / 3`` by default.
        call_timeout_s: how long one keep-alive waits for an answer before it is
            sent again: by default the interval with several etcd endpoints,
            and the lease's whole remaining time with one (there is no other
            member to try, so a shorter wait would only turn a slow answer into
            a retry of the same member). Each retry that follows a failure may
            wait twice as long; no attempt waits past the lease's deadline.

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
        self._expires_at = 0.0  # monotonic: when the lease runs out without a refresh
        self._closed = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None

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
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: the lease keeper was already started")
        granted_at = time.monotonic()
        self._lease_id = self._client.grant_lease(self.ttl_s)
        self._expires_at = granted_at + self.ttl_s
        self._thread = threading.Thread(
            target=self._run, name=f"lease-keeper {self.name}", daemon=True
        )
        self._thread.start()
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
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._client.config.timeout_s + 1)
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
        return self.start() if self._thread is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # the keep-alive thread ----------------------------------------------------

    def _run(self) -> None:
        lease_id = self.lease_id
        delay = self._interval
        wait_for_answer = self._call_timeout
        while not self._closed.wait(min(delay, self.remaining_s())):
            if time.monotonic() >= self._expires_at:
                self._declare_lost(f"no keep-alive succeeded for {self.ttl_s} s")
                return
            sent_at = time.monotonic()
            try:
                # Resending is safe (see the module docstring): a keep-alive
                # only restarts the TTL, however many arrive.
                ttl = self._client.refresh_lease(
                    lease_id, timeout_s=min(wait_for_answer, max(self.remaining_s(), 0.01))
                )
            except LeaseExpiredError:
                self._declare_lost("etcd says it no longer exists")
                return
            except EtcdError as exc:
                # Transient (etcd restarting, a member cut off, a slow answer):
                # retry soon, with a backoff, but never past the lease's own
                # deadline. The client quarantined the member that failed, so
                # the retry goes to another one; it may wait longer, in case
                # etcd is slow rather than gone.
                wait_for_answer *= 2
                delay = min(
                    self._interval, _FIRST_RETRY_S if delay >= self._interval else delay * 2
                )
                log.info(
                    "%s: keep-alive of lease %x failed (%s); %.1f s left, retrying",
                    self.name,
                    lease_id,
                    exc,
                    self.remaining_s(),
                )
                continue
            # Count the TTL from when the request left: the server refreshed
            # it at some moment after that, never before.
            self._expires_at = sent_at + ttl
            delay = self._interval
            wait_for_answer = self._call_timeout

    def _declare_lost(self, why: str) -> None:
        if self._closed.is_set():
            return
        self._lost.set()
        log.warning("%s: lease %x is lost: %s", self.name, self.lease_id, why)
        if self._on_lost is None:
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
