"""The etcd client tidal uses: one factory, one facade, one call path.

:func:`create_client` builds an :class:`EtcdClient` from an
:class:`~rendezvous.etcd.config.EtcdConfig` (several endpoints, a timeout on
every call, optional TLS with a client certificate, optional user/password).
The facade exposes the handful of etcd operations tidal needs (get, range, put,
delete, transactions, leases, watch streams, status, compaction) with plain
Python types (:mod:`rendezvous.etcd.types`).

Every request goes through one path, :meth:`EtcdClient._send`: it sends one
message with a deadline (the client's, or a shorter one the caller gives),
translates a failure once (:mod:`rendezvous.etcd.translate`), tells the
endpoint picker how the member behaved, and retries only what is safe:

* Calls that keep something alive (rendezvous heartbeats, lease keep-alives)
  take a deadline of their own, far shorter than the client's: an answer that
  comes after the liveness window is worthless, and a member that swallows
  packets must cost one short deadline, not the whole window, before the
  caller's retry goes to another member.
* pyetcd's default timeout is ``None`` (wait forever). Every call here has one.
* pyetcd authenticates a user once, at construction, against one endpoint
  picked at random. etcd forgets simple tokens when it restarts, expires JWT
  ones and outdates both when users or roles change; we authenticate again
  when etcd rejects our token, and retry the call once.
* A request refused by a member that is down never reached it: it is sent once
  more, to another member. One whose deadline expired may have been applied
  and is not resent here: callers that know their call is idempotent retry it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc

from rendezvous.errors import EtcdError, EtcdUnavailableError, LeaseExpiredError
from rendezvous.etcd import LOGGER_NAME
from rendezvous.etcd.config import EtcdConfig
from rendezvous.etcd.keepalive import KeepAliveStream
from rendezvous.etcd.messages import (
    delete_request,
    key_value,
    range_request,
    txn_request,
    txn_result,
)
from rendezvous.etcd.stream import WatchStream
from rendezvous.etcd.translate import TokenRejectedError, translate_rpc_error, was_not_delivered
from rendezvous.etcd.transport import create_transport
from rendezvous.etcd.types import Compare, KeyValue, TxnOp, TxnResult, prefix_range_end
from rendezvous.keys import Keys

log = logging.getLogger(LOGGER_NAME)

T = TypeVar("T")

#: The least deadline of an authentication (see :meth:`EtcdClient._send`): an etcd on a
#: 2-core machine at a load of 25 took over 5 s to check a password.
AUTHENTICATE_TIMEOUT_S = 15.0


def _same(resp: Any) -> Any:
    return resp


class EtcdClient:
    """A thin, typed facade over etcd's gRPC API with a deadline on every call.

    Build it with :func:`create_client`. Thread-safe: gRPC channels are.
    Create it after forking worker processes, never before (gRPC channels do
    not survive ``fork()``).
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.keys = Keys(config.root)
        self._timeout = config.timeout_s
        self._auth_lock = threading.Lock()
        self._client = create_transport(config)
        if config.user is not None:
            try:
                self._first_answer(self._authenticate)
            except BaseException:
                self.close()
                raise

    # construction -------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The etcd endpoint (``host:port``) the next call goes to."""
        return str(self._client.picker.pick())

    def _first_answer(self, call: Callable[[], T]) -> T:
        """Run ``call``, trying the next endpoint while one does not answer.

        A failed call quarantines its endpoint (see
        :class:`~rendezvous.etcd.endpoints.EndpointPicker`), so each retry
        reaches another member: one member down must not stop a process from
        starting. Used for reads and authentication only, which are safe to
        send again.
        """
        for _ in range(len(self.config.endpoints) - 1):
            try:
                return call()
            except EtcdUnavailableError as exc:
                log.warning("%s; trying the next endpoint", exc)
        return call()

    def _authenticate(self) -> None:
        """Get an auth token for ``config.user``: at start, and again whenever etcd
        stops accepting the one we hold (etcd restarted, the token expired, or
        the users and roles changed)."""
        assert self.config.user is not None and self.config.password is not None
        request = etcdrpc.AuthenticateRequest(
            name=self.config.user, password=self.config.password.get_secret_value()
        )
        token: str = self._send(
            f"authenticate user {self.config.user!r}",
            ("authstub", "Authenticate", request),
            read=lambda resp: str(resp.token),
            token=False,  # this call is how we get one
        )
        self._client.set_token(token, secure=self.config.secure)

    def close(self) -> None:
        """Close the gRPC channels. The client is unusable afterwards."""
        try:
            self._client.close()
        except Exception:  # closing twice, or a channel already gone
            log.debug("closing the etcd client failed", exc_info=True)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the one call path ----------------------------------------------------------

    def _timeout_of(self, timeout_s: float | None) -> float:
        """The deadline of one call: ``timeout_s`` if given and shorter than the client's."""
        if timeout_s is None:
            return self._timeout
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be positive")
        return min(timeout_s, self._timeout)

    def _send(
        self,
        what: str,
        rpc: tuple[str, str, Any],
        *,
        timeout_s: float | None = None,
        read: Callable[[Any], T] = _same,
        token: bool = True,
        stream: bool = False,
    ) -> T:
        """Send one request to etcd with a deadline and read its answer.

        Args:
            what: the call, for errors and logs ("get /tidal/jobs/j1").
            rpc: the stub property, the method and the request message.
            timeout_s: deadline of this call, if shorter than the client's.
            read: turns the answer into the result; runs within the call, so a
                stream that fails while it is read is translated too.
            token: send our auth token; without one (authenticating) the call
                is made once, with no retry.
            stream: the RPC takes a stream of requests (see
                :meth:`~rendezvous.etcd.transport.Transport.call`).

        Raises:
            EtcdError: the call failed, translated by
                :func:`~rendezvous.etcd.translate.translate_rpc_error`.
        """
        stub, method, request = rpc
        # The one call without a token is authentication, which etcd makes slow on purpose
        # (a bcrypt hash per call, on etcd's CPU) and which fails a process's start: it
        # gets at least AUTHENTICATE_TIMEOUT_S, even from a client of short deadlines.
        timeout = self._timeout_of(timeout_s) if token else max(self._timeout,
                                                                AUTHENTICATE_TIMEOUT_S)

        def call() -> T:
            answer = self._client.call(stub, method, request, timeout, token=token, stream=stream)
            return read(answer)

        if not token:
            return self._attempt(what, call, timeout)
        return self._call(what, call, timeout)

    def _call(
        self, what: str, call: Callable[[], T], timeout: float, *, round_trip: bool = True
    ) -> T:
        """Run ``call`` (one etcd call) by the retry policy; see :meth:`_attempt`.

        etcd rejected our token: authenticate again and run it once more. A
        member that refuses connections never saw the request, so trying the
        next endpoint is safe even for a write: the failure has quarantined
        that member and the picker chooses another one. (A call whose deadline
        expired is NOT resent: it may have been applied. Callers that know
        their call is idempotent retry it.)
        """
        try:
            return self._with_fresh_token(what, call, timeout, round_trip)
        except EtcdUnavailableError as exc:
            if len(self.config.endpoints) < 2 or not was_not_delivered(exc):
                raise
            log.info("%s; trying another endpoint", exc)
            return self._with_fresh_token(what, call, timeout, round_trip)

    def _with_fresh_token(
        self, what: str, call: Callable[[], T], timeout: float, round_trip: bool
    ) -> T:
        token = self._client.metadata
        try:
            return self._attempt(what, call, timeout, round_trip)
        except TokenRejectedError as exc:
            if self.config.user is None:
                raise
            self._renew_token(token, exc)
            return self._attempt(what, call, timeout, round_trip)

    def _renew_token(self, seen: Any, why: Exception) -> None:
        """Authenticate again, unless another thread did since ``seen`` was our token."""
        with self._auth_lock:
            if self._client.metadata == seen:
                log.info("%s; authenticating again", why)
                self._authenticate()

    def _attempt(
        self, what: str, call: Callable[[], T], timeout: float, round_trip: bool = True
    ) -> T:
        """Run ``call`` once; a gRPC error is blamed on its endpoint and translated.

        An answer clears whatever the picker held against the endpoint;
        ``round_trip`` False (opening a watch stream, which does not wait for
        etcd) does not.
        """
        client = self._client
        client.forget_used()
        try:
            result = call()
        except grpc.RpcError as exc:
            client.blame(exc)
            raise self._translate(what, exc, timeout) from exc
        used = client.used
        if round_trip and used is not None:
            client.picker.answered(used)
        return result

    def _translate(self, what: str, exc: grpc.RpcError, timeout: float | None = None) -> EtcdError:
        return translate_rpc_error(
            what,
            exc,
            config=self.config,
            used=self._client.used,
            timeout_s=timeout or self._timeout,
        )

    # key-value ----------------------------------------------------------------

    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        """The current value of ``key``, or None if it does not exist.

        Args:
            key: the key.
            timeout_s: deadline of this call, if shorter than the client's.

        Raises:
            EtcdUnavailableError: the endpoint did not answer in time (it is
                quarantined: the next call goes to another member).
        """
        return self._send(
            f"get {key}",
            ("kvstub", "Range", range_request(key)),
            timeout_s=timeout_s,
            read=lambda resp: key_value(resp.kvs[0]) if resp.count else None,
        )

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the store revision read at."""
        return self._send(
            f"get prefix {prefix}",
            ("kvstub", "Range", range_request(prefix, prefix=True, sorted_by_key=True)),
            read=lambda resp: ([key_value(kv) for kv in resp.kvs], resp.header.revision),
        )

    def count_prefix(self, prefix: str) -> int:
        """How many keys live under ``prefix``."""
        return self._send(
            f"count prefix {prefix}",
            ("kvstub", "Range", range_request(prefix, prefix=True, count_only=True)),
            read=lambda resp: int(resp.count),
        )

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write ``key``; returns the revision of the write."""
        request = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        return self._send(
            f"put {key}",
            ("kvstub", "Put", request),
            read=lambda resp: int(resp.header.revision),
        )

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return self._send(
            f"delete {key}",
            ("kvstub", "DeleteRange", delete_request(key)),
            read=lambda resp: bool(resp.deleted >= 1),
        )

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        return self._send(
            f"delete prefix {prefix}",
            ("kvstub", "DeleteRange", delete_request(prefix, prefix=True)),
            read=lambda resp: int(resp.deleted),
        )

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[TxnOp] = (),
        failure: Sequence[TxnOp] = (),
        *,
        timeout_s: float | None = None,
    ) -> TxnResult:
        """Run an etcd transaction: if every guard holds, ``success``, else ``failure``.

        Args:
            compare: the guards.
            success: the operations run if every guard holds.
            failure: the operations run otherwise.
            timeout_s: deadline of this call, if shorter than the client's.

        Raises:
            EtcdUnavailableError: the endpoint did not answer in time. The
                transaction may still have been applied: resend it only if it
                is guarded so that applying it twice is harmless, and read
                back what happened.
        """
        return self._send(
            "transaction",
            ("kvstub", "Txn", txn_request(compare, success, failure)),
            timeout_s=timeout_s,
            read=txn_result,
        )

    # leases ---------------------------------------------------------------------

    def grant_lease(self, ttl_s: int, *, timeout_s: float | None = None) -> int:
        """Grant a lease of ``ttl_s`` seconds (etcd raises anything below ~2 s).

        Args:
            ttl_s: the lease's time to live.
            timeout_s: deadline of this call, if shorter than the client's. A
                grant that timed out may have created a lease nobody knows
                of; it holds no key and expires after ``ttl_s``.
        """
        if ttl_s < 1:
            raise ValueError(f"lease ttl ({ttl_s}) must be at least 1 second")
        resp: Any = self._send(
            f"grant lease ttl={ttl_s}",
            ("leasestub", "LeaseGrant", etcdrpc.LeaseGrantRequest(TTL=ttl_s, ID=0)),
            timeout_s=timeout_s,
        )
        if resp.error:
            raise EtcdError(f"etcd refused to grant a lease of {ttl_s} s: {resp.error}")
        return int(resp.ID)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys. A lease already gone is not an error."""
        with contextlib.suppress(LeaseExpiredError):
            self._send(
                f"revoke lease {lease_id:x}",
                ("leasestub", "LeaseRevoke", etcdrpc.LeaseRevokeRequest(ID=lease_id)),
            )

    def refresh_lease(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        """Send one keep-alive; returns the lease's new TTL in seconds.

        Args:
            lease_id: the lease to keep alive.
            timeout_s: deadline of this call, if shorter than the client's: a
                keep-alive is worthless once the lease it refreshes has run out.

        Raises:
            LeaseExpiredError: the lease no longer exists.
            EtcdUnavailableError: etcd did not answer in time.
        """

        def first_ttl(responses: Iterator[Any]) -> int:
            # A stream of one request; list() reads until etcd ends the stream.
            answers = list(responses)
            return int(answers[0].TTL) if answers else 0

        ttl = self._send(
            f"refresh lease {lease_id:x}",
            ("leasestub", "LeaseKeepAlive", etcdrpc.LeaseKeepAliveRequest(ID=lease_id)),
            timeout_s=timeout_s,
            read=first_ttl,
            stream=True,
        )
        if ttl <= 0:
            raise LeaseExpiredError(f"lease {lease_id:x} has expired")
        return ttl

    def lease_keepalive(self) -> KeepAliveStream:
        """Open one LeaseKeepAlive stream, for the keep-alives of many leases.

        The stream lives until cancelled; its owner sends lease ids and reads
        ``(id, ttl)`` answers (see :class:`~rendezvous.etcd.keepalive.KeepAliveStream`).
        It carries the client's auth token; when etcd rejects the token the
        client authenticates again, so that the next stream carries a fresh one.
        :class:`rendezvous.lease.KeepAlives` keeps every lease of a process on one.
        """
        what = "lease keep-alive stream"
        token = self._client.metadata

        def token_rejected() -> None:
            if self.config.user is not None:
                self._renew_token(token, EtcdError(f"etcd refused the token of the {what}"))

        return KeepAliveStream(
            open_call=lambda requests: self._call(
                what, lambda: self._client.open_keepalive(requests), self._timeout,
                round_trip=False,
            ),
            translate=self._translate,
            blame=self._client.blame,
            token_rejected=token_rejected,
        )

    def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease in seconds; -1 if it does not exist."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True)
        return self._send(
            f"lease ttl {lease_id:x}",
            ("leasestub", "LeaseTimeToLive", request),
            read=lambda info: int(info.TTL),
        )

    # cluster --------------------------------------------------------------------

    def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The answering member's version, db size, raft term and the store revision.

        Args:
            timeout_s: deadline of this call, if shorter than the client's.
        """
        return self._send(
            "status",
            ("maintenancestub", "Status", etcdrpc.StatusRequest()),
            timeout_s=timeout_s,
            read=lambda resp: {
                "version": resp.version,
                "db_size": resp.dbSize,
                "leader": resp.leader,
                "raft_term": resp.raftTerm,
                "revision": resp.header.revision,
            },
        )

    def compact(self, revision: int) -> None:
        """Compact the history up to ``revision``; watches older than it fail."""
        self._send(
            f"compact {revision}",
            ("kvstub", "Compact", etcdrpc.CompactionRequest(revision=revision)),
        )

    # watch -----------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool, start_revision: int) -> WatchStream:
        """Open a watch stream on ``key`` (or every key under it) from ``start_revision``.

        The stream is a plain iterator of
        :class:`~rendezvous.etcd.types.WatchBatch`; it ends when
        :meth:`WatchStream.cancel` is called and raises
        :class:`EtcdCompactedError` or :class:`EtcdUnavailableError` when the
        watch can no longer deliver every event; etcd must confirm it within
        the client's timeout. Reconnecting (re-list, then re-watch) is the
        caller's job: see :mod:`rendezvous.watch`.
        """
        what = f"watch {key}"
        create = etcdrpc.WatchCreateRequest(
            key=key.encode(),
            range_end=prefix_range_end(key) if prefix else b"",
            start_revision=start_revision,
            progress_notify=True,
        )
        opened_on: list[str] = []

        def open_call(requests: Iterator[Any]) -> Any:
            call, endpoint = self._client.open_watch(requests)
            if endpoint is not None:
                opened_on.append(endpoint)
            return call

        def blame(exc: grpc.RpcError | None) -> None:
            if opened_on:
                self._client.blame(exc, opened_on[0])

        return WatchStream(
            what=what,
            create=etcdrpc.WatchRequest(create_request=create),
            open_call=lambda requests: self._call(
                what, lambda: open_call(requests), self._timeout, round_trip=False
            ),
            translate=self._translate,
            create_timeout_s=self._timeout,
            blame=blame,
        )


def create_client(config: EtcdConfig, *, probe: bool = True) -> EtcdClient:
    """Build the etcd client of this process.

    Args:
        config: endpoints, timeout, TLS, credentials and key root.
        probe: ask etcd for its status once, so that an unreachable etcd or a
            refused certificate is reported here, within ``config.timeout_s``,
            rather than on first use.

    Returns:
        A ready :class:`EtcdClient`.

    Raises:
        EtcdUnavailableError: no endpoint answered within the timeout.
        EtcdAuthError: etcd refused the credentials: the user or password, or
            the TLS handshake (no client certificate or one etcd does not
            trust, a server certificate the CA does not verify or that does
            not name the host); the message says which.
        EtcdError: the configuration is unusable (a certificate cannot be read).
    """
    client = EtcdClient(config)
    if probe:
        try:
            client._first_answer(client.status)
        except BaseException:
            client.close()
            raise
    return client


#: How long a daemon (agent, coordinator) waits at start for etcd to answer: etcd may
#: start after it, or be too loaded to answer within the client's timeout (a test run on
#: 2 cores saw an agent's first status call time out after 5 s while its peers started).
STARTUP_WAIT_S = 60.0


def create_client_waiting(
    config: EtcdConfig,
    *,
    wait_s: float = STARTUP_WAIT_S,
    stop: threading.Event | None = None,
    retry_s: float = 1.0,
) -> EtcdClient:
    """:func:`create_client`, tried again while etcd does not answer, for up to ``wait_s``.

    Each failed try is logged (a warning naming the endpoint and why). Refused
    credentials or an unusable configuration raise at once: they do not mend.

    Raises:
        EtcdUnavailableError: the last try's, once ``wait_s`` is over or ``stop`` is set.
        EtcdAuthError, EtcdError: as :func:`create_client`, at once.
    """
    deadline = time.monotonic() + wait_s
    pause = stop if stop is not None else threading.Event()  # an event nobody sets: a sleep
    tries = 0
    while True:
        tries += 1
        try:
            return create_client(config)
        except EtcdUnavailableError as exc:
            left = deadline - time.monotonic()
            if left <= 0 or pause.is_set():
                raise
            log.warning("%s; trying again (try %d, %.0f s left)", exc, tries, left)
            pause.wait(min(retry_s, left))


__all__ = ["STARTUP_WAIT_S", "EtcdClient", "create_client", "create_client_waiting"]
