"""The etcd client tidal uses: one factory, one facade, errors translated once.

:func:`create_client` builds an :class:`EtcdClient` from an :class:`EtcdConfig`
(several endpoints, a timeout on every call, optional TLS with a client
certificate, optional user/password). The facade exposes the handful of etcd
operations tidal needs (get, range, put, delete, transactions, leases, watch
streams, status, compaction) with plain Python types, and turns every pyetcd or
gRPC exception into the :mod:`rendezvous.errors` hierarchy. Nothing outside this
module imports pyetcd or grpc.

Why a facade rather than pyetcd's client directly:

* pyetcd marks an endpoint "failed" for 300 s after one error and, without
  failover, refuses to use it again until then: an etcd restart would make the
  client useless for five minutes. With failover it marks whichever endpoint
  is current when an error comes back, not the one the failed call went to,
  so with several threads a healthy member gets the blame. We pick endpoints
  ourselves (:class:`EndpointPicker`): a member that refused a call is
  skipped for 2 s, one that did not answer in time (cut off, paused) for
  10 s and longer while it stays silent, and no endpoint is ever refused
  outright. gRPC's reconnect backoff is kept short.
* Calls that keep something alive (rendezvous heartbeats, lease keep-alives)
  take a deadline of their own, far shorter than the client's: an answer that
  comes after the liveness window is worthless, and a member that swallows
  packets must cost one short deadline, not the whole window, before the
  caller's retry goes to another member.
* pyetcd's callback watcher drops every watch on a connection error and only
  logs callback exceptions. :meth:`EtcdClient.watch` is a plain stream the
  caller iterates; :mod:`rendezvous.watch` builds list-then-watch with
  reconnects on top of it.
* pyetcd's default timeout is ``None`` (wait forever). Every call here has one.
* pyetcd authenticates a user once, at construction, against one endpoint
  picked at random. etcd forgets simple tokens when it restarts, expires JWT
  ones and outdates both when users or roles change; we authenticate again
  when etcd rejects our token, and retry the call once.
* pyetcd reports a refused TLS handshake as a bare "connection failed"; the
  errors here name the problem (no client certificate, the wrong CA, a server
  certificate that does not name the host).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc
from pyetcd import exceptions as pyetcd_exc
from pyetcd.client import Endpoint, EtcdTokenCallCredentials, MultiEndpointEtcd3Client

from rendezvous.errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    LeaseExpiredError,
)
from rendezvous.etcd.config import EtcdConfig, parse_endpoint
from rendezvous.etcd.endpoints import (
    MAX_QUARANTINE_S,
    REFUSED_QUARANTINE_S,
    SILENT_QUARANTINE_S,
    EndpointPicker,
)
from rendezvous.etcd.types import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    Get,
    KeyValue,
    Put,
    TxnOp,
    TxnResult,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)
from rendezvous.keys import Keys

log = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC reconnects with exponential backoff up to 120 s by default; after an etcd
# restart we want to be back within about a second.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Pings only while a call (a watch, a keep-alive) is open: etcd's server
    # enforces PermitWithoutStream=false and answers pings on an idle
    # connection with GOAWAY "too_many_pings", dropping it. An idle connection
    # needs no liveness check: the next call's own deadline is the check.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


# etcd no longer accepts the token we hold: get a new one and retry (what
# etcd's own Go client does). Simple tokens live in the memory of the member
# and die with it; JWT tokens expire; a change of users or roles outdates both.
# gRPC details that mean the request never reached a member (safe to resend).
_NOT_DELIVERED = ("failed to connect to all addresses", "Connection refused", "No route to host")
_TOKEN_REJECTED = ("invalid auth token", "revision of auth store is old")
# etcd answers these with INVALID_ARGUMENT or FAILED_PRECONDITION, not UNAUTHENTICATED.
_AUTH_REFUSED = ("authentication failed", "authentication is not enabled", "user name is empty")


class _AuthTokenRejectedError(EtcdAuthError):
    """etcd refused our auth token (not our user): authenticating again fixes it."""


def _tls_problem(detail: str, config: EtcdConfig) -> str | None:
    """A sentence naming what went wrong in a TLS handshake with etcd, from gRPC's
    error details; None when they show no TLS failure (etcd merely unreachable)."""
    text = detail.lower()
    if "hostname verification" in text or "peer name" in text:
        return (
            "etcd's server certificate does not name the host it was reached at: "
            "add that name or IP address to the certificate's subject alternative names"
        )
    if "certificate_verify_failed" in text:
        return (
            f"etcd's server certificate could not be verified with the CA in {config.ca_cert}: "
            "is that the CA that signed it, and is the certificate still valid?"
        )
    if config.secure and any(
        sign in text for sign in ("bad_certificate", "certificate_required", "tsi_data_corrupted")
    ):
        # TLS 1.3: etcd checks the client certificate after the client's half of
        # the handshake, so its refusal arrives as a corrupt first record.
        if config.cert_cert is None:
            return (
                "etcd closed the TLS connection: it requires a client certificate and none "
                "was given (--etcd-cert and --etcd-key, or TIDAL_ETCD_CERT and TIDAL_ETCD_KEY)"
            )
        return (
            f"etcd refused the client certificate {config.cert_cert}: is it signed by a CA "
            "in etcd's --trusted-ca-file, and still valid?"
        )
    return None


# gRPC codes that blame the endpoint: it is unreachable, silent or broken.
_ENDPOINT_FAULTS = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
)
# UNAVAILABLE details that mean "no answer" rather than "refused": gRPC's
# keep-alive gave up on a connection whose packets vanish, or the deadline
# ended a TCP handshake that got no reply.
_SILENT_DETAILS = ("timed out", "keepalive watchdog timeout", "handshaker shutdown")


def _is_silence(exc: grpc.RpcError) -> bool:
    """True if ``exc`` says the endpoint did not answer (rather than refused)."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    detail = (exc.details() or "").lower() if hasattr(exc, "details") else ""
    return any(sign in detail for sign in _SILENT_DETAILS)


class _PyetcdClient(MultiEndpointEtcd3Client):  # type: ignore[misc]  # pyetcd is untyped
    """pyetcd's multi-endpoint client, with the endpoint of each call chosen by an
    :class:`EndpointPicker`.

    pyetcd reaches a member through its stub properties (``kvstub``, ...) and
    ``channel``; here every such access asks the picker, and records, for the
    calling thread, which endpoint the call goes to, so that a failure is
    blamed on that endpoint. pyetcd's own bookkeeping (``Endpoint.fail``,
    ``time_retry``) is left unused.
    """

    def __init__(self, endpoints: list[Endpoint], timeout: float) -> None:
        super().__init__(endpoints=endpoints, timeout=timeout, failover=True)
        # pyetcd chose a random first endpoint: the clients of a cluster spread
        # over its members instead of all loading the first one.
        self.picker = EndpointPicker(list(self.endpoints), first=self._current_endpoint_label)
        self._used = threading.local()
        self._stubs_by_endpoint: dict[tuple[str, str], Any] = {}

    def _use(self) -> str:
        endpoint = self.picker.pick()
        self._used.endpoint = endpoint
        return endpoint

    @property
    def used(self) -> str | None:
        """The endpoint this thread's latest call went to (None: none since :meth:`forget_used`)."""
        return getattr(self._used, "endpoint", None)

    def forget_used(self) -> None:
        self._used.endpoint = None

    def _stub(self, name: str, factory: Callable[[Any], Any]) -> Any:
        endpoint = self._use()
        stub = self._stubs_by_endpoint.get((endpoint, name))
        if stub is None:
            stub = self._stubs_by_endpoint.setdefault(
                (endpoint, name), factory(self.endpoints[endpoint].channel)
            )
        return stub

    @property
    def authstub(self) -> Any:
        return self._stub("auth", etcdrpc.AuthStub)

    @property
    def kvstub(self) -> Any:
        return self._stub("kv", etcdrpc.KVStub)

    @property
    def clusterstub(self) -> Any:
        return self._stub("cluster", etcdrpc.ClusterStub)

    @property
    def leasestub(self) -> Any:
        return self._stub("lease", etcdrpc.LeaseStub)

    @property
    def maintenancestub(self) -> Any:
        return self._stub("maintenance", etcdrpc.MaintenanceStub)

    @property
    def channel(self) -> Any:
        return self.endpoints[self._use()].channel

    def blame(self, exc: grpc.RpcError | None, endpoint: str | None = None) -> None:
        """Quarantine the endpoint a failed call went to (this thread's latest by
        default) if ``exc`` is the endpoint's fault; None: it did not answer in time."""
        endpoint = endpoint or self.used
        if endpoint is None:
            return
        if exc is None:
            self.picker.failed(endpoint, silent=True)
        elif hasattr(exc, "code") and exc.code() in _ENDPOINT_FAULTS:
            self.picker.failed(endpoint, silent=_is_silence(exc))

    def _manage_grpc_errors(self, exc: grpc.RpcError) -> None:
        """Blame the endpoint this thread's call went to, then raise pyetcd's error
        for ``exc`` (called inside the ``except`` that caught it, as pyetcd does)."""
        self.blame(exc)
        super()._manage_grpc_errors(exc)


_TARGETS = {
    "version": etcdrpc.Compare.VERSION,
    "create": etcdrpc.Compare.CREATE,
    "mod": etcdrpc.Compare.MOD,
    "value": etcdrpc.Compare.VALUE,
    "lease": etcdrpc.Compare.LEASE,
}
_OPS = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


class EtcdClient:
    """A thin, typed facade over pyetcd with a deadline on every call.

    Build it with :func:`create_client`. Thread-safe: gRPC channels are.
    Create it after forking worker processes, never before (gRPC channels do
    not survive ``fork()``).
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.keys = Keys(config.root)
        self._timeout = config.timeout_s
        self._where = ", ".join(config.endpoints)
        self._auth_lock = threading.Lock()
        self._client = self._build(config)
        if config.user is not None:
            try:
                self._first_answer(self._authenticate)
            except BaseException:
                self.close()
                raise

    # construction -------------------------------------------------------------

    def _build(self, config: EtcdConfig) -> MultiEndpointEtcd3Client:
        creds = None
        if config.secure:
            if (config.cert_cert is None) != (config.cert_key is None):
                raise EtcdError("etcd TLS: cert_cert and cert_key must be given together")
            try:
                creds = MultiEndpointEtcd3Client.get_secure_creds(
                    str(config.ca_cert),
                    str(config.cert_key) if config.cert_key else None,
                    str(config.cert_cert) if config.cert_cert else None,
                )
            except OSError as exc:
                raise EtcdError(f"etcd TLS: cannot read a certificate file: {exc}") from exc
        if (config.user is None) != (config.password is None):
            raise EtcdError("etcd auth: user and password must be given together")
        endpoints = []
        for text in config.endpoints:
            host, port = parse_endpoint(text)
            endpoints.append(
                Endpoint(
                    host,
                    port,
                    secure=config.secure,
                    creds=creds,
                    time_retry=0.0,  # unused: the EndpointPicker decides
                    opts=_GRPC_OPTIONS,
                )
            )
        # No user here: pyetcd would authenticate once, against one endpoint
        # picked at random, and never again. :meth:`_authenticate` does it.
        return _PyetcdClient(endpoints, self._timeout)

    @property
    def endpoint(self) -> str:
        """The etcd endpoint (``host:port``) the next call goes to."""
        return str(self._client.picker.pick())

    def _first_answer(self, call: Callable[[], T]) -> T:
        """Run ``call``, trying the next endpoint while one does not answer.

        A failed call quarantines its endpoint (see :class:`EndpointPicker`),
        so each retry reaches another member: one member down must not stop a
        process from starting. Used for reads and authentication only, which
        are safe to send again.
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

        def call() -> str:
            stub = self._client.authstub  # no token: this call is how we get one
            try:
                return str(stub.Authenticate(request, self._timeout).token)
            except grpc.RpcError as exc:
                self._client._manage_grpc_errors(exc)  # blames the endpoint, raises
                raise

        token = self._translate_once(f"authenticate user {self.config.user!r}", call)
        # gRPC refuses to send call credentials over a plain channel ("does not
        # have a sufficient security level"); the metadata carries the token there.
        self._client.call_credentials = (
            grpc.metadata_call_credentials(EtcdTokenCallCredentials(token))
            if self.config.secure
            else None
        )
        # Last: :meth:`_translate` takes a new metadata for "authenticated again".
        self._client.metadata = (("token", token),)

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

    # calls and error translation ----------------------------------------------

    def _timeout_of(self, timeout_s: float | None) -> float:
        """The deadline of one call: ``timeout_s`` if given and shorter than the client's."""
        if timeout_s is None:
            return self._timeout
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be positive")
        return min(timeout_s, self._timeout)

    def _rpc(self, stub: str, method: str, request: Any, timeout: float) -> Any:
        """One unary call, on the endpoint the picker chooses, with our token."""
        client = self._client
        try:
            return getattr(getattr(client, stub), method)(
                request, timeout, credentials=client.call_credentials, metadata=client.metadata
            )
        except grpc.RpcError as exc:
            client._manage_grpc_errors(exc)  # blames the endpoint, raises pyetcd's error
            raise

    def _translate(
        self,
        what: str,
        call: Callable[[], T],
        *,
        timeout: float | None = None,
        round_trip: bool = True,
    ) -> T:
        """Run ``call`` (one etcd call), translating its errors; see :meth:`_translate_once`."""
        try:
            return self._translate_authenticated(what, call, timeout, round_trip)
        except EtcdUnavailableError as exc:
            # A member that refuses connections never saw the request, so trying
            # the next endpoint is safe even for a write. The failure has
            # quarantined that member: the picker chooses another one. (A call
            # whose deadline expired is NOT resent here: it may have been
            # applied. Callers that know their call is idempotent retry it.)
            if len(self.config.endpoints) < 2 or not any(
                marker in str(exc) for marker in _NOT_DELIVERED
            ):
                raise
            log.info("%s; trying another endpoint", exc)
            return self._translate_authenticated(what, call, timeout, round_trip)

    def _translate_authenticated(
        self, what: str, call: Callable[[], T], timeout: float | None, round_trip: bool
    ) -> T:
        token = self._client.metadata
        try:
            return self._translate_once(what, call, timeout, round_trip)
        except _AuthTokenRejectedError as exc:
            if self.config.user is None:
                raise
            with self._auth_lock:
                if self._client.metadata == token:  # no other thread got a new one yet
                    log.info("%s; authenticating again", exc)
                    self._authenticate()
            return self._translate_once(what, call, timeout, round_trip)

    def _translate_once(
        self,
        what: str,
        call: Callable[[], T],
        timeout: float | None = None,
        round_trip: bool = True,
    ) -> T:
        """Run ``call``; turn pyetcd's and gRPC's errors into :mod:`rendezvous.errors`.

        ``timeout`` is the call's deadline, for the error message. An answer
        clears whatever the picker held against the endpoint; ``round_trip``
        False (opening a watch stream, which does not wait for etcd) does not.
        """
        client = self._client
        client.forget_used()
        try:
            result = call()
        except EtcdError:
            raise
        except (
            pyetcd_exc.ConnectionFailedError,
            pyetcd_exc.ConnectionTimeoutError,
            pyetcd_exc.NoServerAvailableError,
        ) as exc:
            # pyetcd raises these from inside its handler of the gRPC error,
            # whose details say why (a refused TLS handshake, a refused port).
            if isinstance(exc.__context__, grpc.RpcError):
                raise self._from_rpc_error(what, exc.__context__, timeout) from exc
            raise EtcdUnavailableError(
                f"etcd at {client.used or self._where} did not answer {what} within "
                f"{timeout or self._timeout:g} s ({type(exc).__name__})"
            ) from exc
        except pyetcd_exc.RevisionCompactedError as exc:
            raise EtcdCompactedError(
                f"{what}: revision compacted (oldest kept: {exc.compacted_revision})",
                exc.compacted_revision,
            ) from exc
        except grpc.RpcError as exc:
            # A streaming call fails while it is read, outside :meth:`_rpc`:
            # nothing blamed its endpoint yet (pyetcd's mapped errors, above,
            # were blamed where they were raised).
            client.blame(exc)
            raise self._from_rpc_error(what, exc, timeout) from exc
        except ValueError as exc:  # pyetcd: "Trying to use a failed node"
            raise EtcdUnavailableError(f"etcd at {self._where}: {what} failed: {exc}") from exc
        used = client.used
        if round_trip and used is not None:
            client.picker.answered(used)
        return result

    def _from_rpc_error(
        self, what: str, exc: grpc.RpcError, timeout: float | None = None
    ) -> EtcdError:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        detail = detail or ""
        if any(reason in detail for reason in _TOKEN_REJECTED):
            return _AuthTokenRejectedError(f"etcd at {self._where} refused {what}: {detail}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or any(
            reason in detail for reason in _AUTH_REFUSED
        ):
            return EtcdAuthError(f"etcd at {self._where} refused {what}: {detail}")
        tls = _tls_problem(detail, self.config) if code == grpc.StatusCode.UNAVAILABLE else None
        if tls is not None:
            return EtcdAuthError(f"etcd at {self._where}: {what} failed: {tls} ({detail})")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space" in detail:
            return EtcdNoSpaceError(f"etcd at {self._where} is out of space: {detail}")
        if "lease not found" in detail:
            return LeaseExpiredError(f"{what}: the lease has expired or was revoked")
        if code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
        ):
            return EtcdUnavailableError(
                f"etcd at {self._client.used or self._where} did not answer {what} within "
                f"{timeout or self._timeout:g} s: {detail}"
            )
        return EtcdError(f"etcd at {self._where}: {what} failed ({code}): {detail}")

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
        timeout = self._timeout_of(timeout_s)
        request = etcdrpc.RangeRequest(key=key.encode())

        def call() -> KeyValue | None:
            resp = self._rpc("kvstub", "Range", request, timeout)
            return _kv(resp.kvs[0]) if resp.count else None

        return self._translate(f"get {key}", call, timeout=timeout)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the store revision read at."""

        def call() -> tuple[list[KeyValue], int]:
            resp = self._client.get_range_response(
                prefix, prefix_range_end(prefix), sort_order="ascend", sort_target="key"
            )
            return [_kv(kv) for kv in resp.kvs], resp.header.revision

        return self._translate(f"get prefix {prefix}", call)

    def count_prefix(self, prefix: str) -> int:
        """How many keys live under ``prefix``."""

        def call() -> int:
            resp = self._client.get_range_response(
                prefix, prefix_range_end(prefix), count_only=True
            )
            return int(resp.count)

        return self._translate(f"count prefix {prefix}", call)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write ``key``; returns the revision of the write."""
        resp = self._translate(
            f"put {key}", lambda: self._client.put(key, value, lease=lease or None)
        )
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return bool(self._translate(f"delete {key}", lambda: self._client.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        resp = self._translate(
            f"delete prefix {prefix}", lambda: self._client.delete_prefix(prefix)
        )
        return int(resp.deleted)

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
        timeout = self._timeout_of(timeout_s)
        request = etcdrpc.TxnRequest(
            compare=[self._compare_message(c) for c in compare],
            success=[self._op_message(op) for op in success],
            failure=[self._op_message(op) for op in failure],
        )

        def call() -> TxnResult:
            resp = self._rpc("kvstub", "Txn", request, timeout)
            gets = tuple(
                tuple(_kv(kv) for kv in r.response_range.kvs)
                for r in resp.responses
                if r.WhichOneof("response") == "response_range"
            )
            return TxnResult(bool(resp.succeeded), int(resp.header.revision), gets)

        return self._translate("transaction", call, timeout=timeout)

    @staticmethod
    def _compare_message(c: Compare) -> Any:
        msg = etcdrpc.Compare(key=c.key.encode(), target=_TARGETS[c.target], result=_OPS[c.op])
        if c.target == "value":
            msg.value = c.value if isinstance(c.value, bytes) else str(c.value).encode()
        elif c.target == "version":
            msg.version = int(c.value)
        elif c.target == "create":
            msg.create_revision = int(c.value)
        elif c.target == "mod":
            msg.mod_revision = int(c.value)
        else:
            msg.lease = int(c.value)
        return msg

    @staticmethod
    def _op_message(op: TxnOp) -> Any:
        if isinstance(op, Put):
            return etcdrpc.RequestOp(
                request_put=etcdrpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease)
            )
        end = prefix_range_end(op.key) if op.prefix else b""
        if isinstance(op, Delete):
            return etcdrpc.RequestOp(
                request_delete_range=etcdrpc.DeleteRangeRequest(key=op.key.encode(), range_end=end)
            )
        return etcdrpc.RequestOp(
            request_range=etcdrpc.RangeRequest(key=op.key.encode(), range_end=end)
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
        timeout = self._timeout_of(timeout_s)
        request = etcdrpc.LeaseGrantRequest(TTL=ttl_s, ID=0)
        resp = self._translate(
            f"grant lease ttl={ttl_s}",
            lambda: self._rpc("leasestub", "LeaseGrant", request, timeout),
            timeout=timeout,
        )
        if resp.error:
            raise EtcdError(f"etcd refused to grant a lease of {ttl_s} s: {resp.error}")
        return int(resp.ID)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys. A lease already gone is not an error."""
        with contextlib.suppress(LeaseExpiredError):
            self._translate(
                f"revoke lease {lease_id:x}", lambda: self._client.revoke_lease(lease_id)
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
        timeout = self._timeout_of(timeout_s)
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def call() -> int:
            # A stream of one request; list() reads until etcd ends the stream.
            responses = list(self._rpc("leasestub", "LeaseKeepAlive", iter([request]), timeout))
            return int(responses[0].TTL) if responses else 0

        ttl = self._translate(f"refresh lease {lease_id:x}", call, timeout=timeout)
        if ttl <= 0:
            raise LeaseExpiredError(f"lease {lease_id:x} has expired")
        return ttl

    def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease in seconds; -1 if it does not exist."""
        info = self._translate(
            f"lease ttl {lease_id:x}", lambda: self._client.get_lease_info(lease_id)
        )
        return int(info.TTL)

    # cluster --------------------------------------------------------------------

    def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The answering member's version, db size, raft term and the store revision.

        Args:
            timeout_s: deadline of this call, if shorter than the client's.
        """
        timeout = self._timeout_of(timeout_s)

        def call() -> dict[str, Any]:
            resp = self._rpc("maintenancestub", "Status", etcdrpc.StatusRequest(), timeout)
            return {
                "version": resp.version,
                "db_size": resp.dbSize,
                "leader": resp.leader,
                "raft_term": resp.raftTerm,
                "revision": resp.header.revision,
            }

        return self._translate("status", call, timeout=timeout)

    def compact(self, revision: int) -> None:
        """Compact the history up to ``revision``; watches older than it fail."""
        self._translate(f"compact {revision}", lambda: self._client.compact(revision))

    # watch -----------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool, start_revision: int) -> WatchStream:
        """Open a watch stream on ``key`` (or every key under it) from ``start_revision``.

        The stream is a plain iterator of :class:`WatchBatch`; it ends when
        :meth:`WatchStream.cancel` is called and raises
        :class:`EtcdCompactedError` or :class:`EtcdUnavailableError` when the
        watch can no longer deliver every event. Reconnecting (re-list, then
        re-watch) is the caller's job: see :mod:`rendezvous.watch`.
        """
        create = etcdrpc.WatchCreateRequest(
            key=key.encode(),
            range_end=prefix_range_end(key) if prefix else b"",
            start_revision=start_revision,
            progress_notify=True,
        )

        opened_on: list[str] = []

        def open_call(requests: Iterator[Any]) -> Any:
            client = self._client
            stub = etcdrpc.WatchStub(client.channel)
            if client.used is not None:
                opened_on.append(client.used)
            return stub.Watch(
                requests, credentials=client.call_credentials, metadata=client.metadata
            )

        def blame(exc: grpc.RpcError | None) -> None:
            if opened_on:
                self._client.blame(exc, opened_on[0])

        return WatchStream(
            what=f"watch {key}",
            create=etcdrpc.WatchRequest(create_request=create),
            open_call=lambda requests: self._translate(
                f"watch {key}", lambda: open_call(requests), round_trip=False
            ),
            translate=self._from_rpc_error,
            create_timeout_s=self._timeout,
            blame=blame,
        )


class WatchStream:
    """One etcd watch stream, iterated by one consumer thread.

    ``cancel()`` may be called from any thread; iteration then stops cleanly.
    """

    def __init__(
        self,
        *,
        what: str,
        create: Any,
        open_call: Callable[[Iterator[Any]], Any],
        translate: Callable[[str, grpc.RpcError], EtcdError],
        create_timeout_s: float,
        blame: Callable[[grpc.RpcError | None], None] | None = None,
    ) -> None:
        self._what = what
        self._blame = blame
        self._requests: queue.Queue[Any] = queue.Queue()
        self._requests.put(create)
        self._translate = translate
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._call = open_call(self._request_iter())
        # A watch whose stream never answers (etcd gone mid-handshake) must not
        # hang its consumer: cancel it if "created" has not arrived in time.
        self._timer = threading.Timer(create_timeout_s, self._create_deadline)
        self._timer.daemon = True
        self._timer.start()
        self._create_timed_out = False

    def _request_iter(self) -> Iterator[Any]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _create_deadline(self) -> None:
        if not self._created.is_set():
            self._create_timed_out = True
            self._call.cancel()

    def cancel(self) -> None:
        """Stop the stream; the iterating thread sees the end of iteration."""
        self._cancelled.set()
        self._timer.cancel()
        self._requests.put(None)
        self._call.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[WatchBatch]:
        try:
            for resp in self._call:
                if resp.created:
                    self._created.set()
                    self._timer.cancel()
                if resp.compact_revision:
                    raise EtcdCompactedError(
                        f"{self._what}: revision compacted (oldest kept: {resp.compact_revision})",
                        int(resp.compact_revision),
                    )
                if resp.canceled:
                    if self._cancelled.is_set():
                        return
                    raise EtcdError(f"{self._what} was cancelled by etcd: {resp.cancel_reason}")
                if resp.created and not resp.events:
                    continue
                yield WatchBatch(
                    revision=int(resp.header.revision),
                    events=tuple(
                        WatchEvent(
                            kind="delete" if ev.type == ev.DELETE else "put",
                            key=ev.kv.key.decode(),
                            value=bytes(ev.kv.value),
                            mod_revision=ev.kv.mod_revision,
                            create_revision=ev.kv.create_revision,
                            lease=ev.kv.lease,
                            version=ev.kv.version,
                        )
                        for ev in resp.events
                    ),
                )
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return
            # The member the watch went to failed it: the re-list and re-watch
            # that follow should go elsewhere.
            if self._blame is not None:
                self._blame(None if self._create_timed_out else exc)
            if self._create_timed_out:
                raise EtcdUnavailableError(
                    f"{self._what}: etcd did not open the watch in time"
                ) from exc
            raise self._translate(self._what, exc) from exc
        finally:
            self._timer.cancel()


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


__all__ = [
    "MAX_QUARANTINE_S",
    "REFUSED_QUARANTINE_S",
    "SILENT_QUARANTINE_S",
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "EndpointPicker",
    "EtcdClient",
    "EtcdConfig",
    "Get",
    "KeyValue",
    "Put",
    "TxnOp",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
    "WatchStream",
    "create_client",
    "parse_endpoint",
    "prefix_range_end",
]
