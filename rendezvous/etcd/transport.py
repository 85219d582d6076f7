"""The gRPC channels to etcd's members, and one call on them.

:class:`Transport` is pyetcd's multi-endpoint client reduced to what it is good
at: one gRPC channel per member (TLS, client certificate, short reconnect
backoff). Which member a call goes to is decided by an
:class:`~rendezvous.etcd.endpoints.EndpointPicker`; every request is sent by
:meth:`Transport.call` with an explicit deadline. pyetcd's own methods, with
their exception classes and ``failed`` bookkeeping, are not used. Errors are
left as ``grpc.RpcError``: the facade translates them
(:mod:`rendezvous.etcd.translate`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd.client import Endpoint, EtcdTokenCallCredentials, MultiEndpointEtcd3Client

from rendezvous.errors import EtcdError
from rendezvous.etcd.config import EtcdConfig, parse_endpoint
from rendezvous.etcd.endpoints import EndpointPicker
from rendezvous.etcd.translate import is_endpoint_fault, is_silence

# gRPC reconnects with exponential backoff up to 120 s by default; after an etcd
# restart we want to be back within about a second.
GRPC_OPTIONS = [
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


class Transport(MultiEndpointEtcd3Client):  # type: ignore[misc]  # pyetcd is untyped
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
    def watchstub(self) -> Any:
        return self._stub("watch", etcdrpc.WatchStub)

    @property
    def channel(self) -> Any:
        return self.endpoints[self._use()].channel

    def call(
        self,
        stub: str,
        method: str,
        request: Any,
        timeout: float,
        *,
        token: bool = True,
        stream: bool = False,
    ) -> Any:
        """Send ``request`` to the endpoint the picker chooses, within ``timeout`` seconds.

        Args:
            stub: the stub property (``"kvstub"``, ``"leasestub"``, ...).
            method: the RPC (``"Range"``, ``"Txn"``, ...).
            request: the request message.
            timeout: the call's deadline in seconds.
            token: send our auth token (not when asking for one).
            stream: the RPC takes a stream of requests: send ``request`` as a
                stream of one (the answer is then an iterator of responses).

        Raises:
            grpc.RpcError: the call failed (translated by the facade).
        """
        rpc = getattr(getattr(self, stub), method)
        body = iter([request]) if stream else request
        if not token:
            return rpc(body, timeout)
        return rpc(body, timeout, credentials=self.call_credentials, metadata=self.metadata)

    def open_watch(self, requests: Iterator[Any]) -> tuple[Any, str | None]:
        """Open a watch stream (no deadline: it lives until cancelled) and say
        which endpoint it went to."""
        stub = self.watchstub
        call = stub.Watch(requests, credentials=self.call_credentials, metadata=self.metadata)
        return call, self.used

    def open_keepalive(self, requests: Iterator[Any]) -> tuple[Any, str | None]:
        """Open a LeaseKeepAlive stream (no deadline: it lives until cancelled) and
        say which endpoint it went to."""
        stub = self.leasestub
        call = stub.LeaseKeepAlive(
            requests, credentials=self.call_credentials, metadata=self.metadata
        )
        return call, self.used

    def set_token(self, token: str, *, secure: bool) -> None:
        """Send ``token`` with every call from now on."""
        # gRPC refuses to send call credentials over a plain channel ("does not
        # have a sufficient security level"); the metadata carries the token there.
        self.call_credentials = (
            grpc.metadata_call_credentials(EtcdTokenCallCredentials(token)) if secure else None
        )
        # Last: the facade takes a new metadata for "authenticated again".
        self.metadata = (("token", token),)

    def blame(self, exc: grpc.RpcError | None, endpoint: str | None = None) -> None:
        """Quarantine the endpoint a failed call went to (this thread's latest by
        default) if ``exc`` is the endpoint's fault; None: it did not answer in time."""
        endpoint = endpoint or self.used
        if endpoint is None:
            return
        if exc is None:
            self.picker.failed(endpoint, silent=True)
        elif is_endpoint_fault(exc):
            self.picker.failed(endpoint, silent=is_silence(exc))


def create_transport(config: EtcdConfig) -> Transport:
    """The channels to every endpoint of ``config``, with its TLS files read.

    Raises:
        EtcdError: the configuration is unusable (a certificate cannot be read,
            half of a certificate pair or of a user/password pair).
    """
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
                opts=GRPC_OPTIONS,
            )
        )
    # No user here: pyetcd would authenticate once, against one endpoint
    # picked at random, and never again. The facade does it.
    return Transport(endpoints, config.timeout_s)


__all__ = ["GRPC_OPTIONS", "Transport", "create_transport"]
