"""etcd's LeaseKeepAlive as one long-lived stream: :class:`KeepAliveStream`.

etcd's ``LeaseKeepAlive`` is a bidirectional gRPC stream: the client sends a
lease id whenever it wants that lease's TTL restarted, and etcd answers each
request with the lease's id and its TTL (0 once the lease is gone). One stream
carries the keep-alives of every lease a process holds, so that a process with
a thousand leases sends a thousand small messages on one HTTP/2 stream instead
of opening a thousand calls. :class:`rendezvous.lease.KeepAlives` owns the
stream and decides when to send; the facade opens it
(:meth:`rendezvous.etcd.facade.EtcdClient.lease_keepalive`) with the client's
auth token, like every other call.

The stream has no deadline of its own (it lives until cancelled): its owner
keeps a deadline per request and, when an answer is late, cancels the stream
with ``silent=True``, which quarantines the member it went to, so that the next
stream goes to another member.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from pyetcd import etcdrpc

from rendezvous.errors import EtcdError
from rendezvous.etcd.translate import TokenRejectedError


class KeepAliveStream:
    """One LeaseKeepAlive stream: :meth:`send` from any thread, iterate answers in one.

    Args:
        open_call: opens the gRPC call on a request iterator; returns the call
            and the endpoint it went to.
        translate: turns a gRPC error into an :class:`EtcdError`.
        blame: quarantines an endpoint (None: it did not answer in time).
        token_rejected: called when etcd refused the stream's auth token, so
            that the next stream is opened with a fresh one.
    """

    def __init__(
        self,
        *,
        open_call: Callable[[Iterator[Any]], tuple[Any, str | None]],
        translate: Callable[[str, grpc.RpcError], EtcdError],
        blame: Callable[[grpc.RpcError | None, str], None],
        token_rejected: Callable[[], None],
    ) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._translate = translate
        self._blame = blame
        self._token_rejected = token_rejected
        self._cancelled = threading.Event()
        self._call, self.endpoint = open_call(self._request_iter())

    def _request_iter(self) -> Iterator[Any]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def send(self, lease_id: int) -> None:
        """Ask etcd to restart the TTL of ``lease_id``; its answer comes by iteration."""
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))

    def cancel(self, *, silent: bool = False) -> None:
        """End the stream; ``silent``: its member left a request unanswered too long."""
        if silent and self.endpoint is not None and not self._cancelled.is_set():
            self._blame(None, self.endpoint)
        self._cancelled.set()
        self._requests.put(None)
        self._call.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """``(lease id, TTL in seconds)`` for each answer; TTL <= 0: the lease is gone.

        Ends when cancelled.

        Raises:
            EtcdError: the stream failed (translated; the member is blamed).
        """
        try:
            for resp in self._call:
                yield int(resp.ID), int(resp.TTL)
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return
            if self.endpoint is not None:
                self._blame(exc, self.endpoint)
            error = self._translate("lease keep-alive stream", exc)
            if isinstance(error, TokenRejectedError):
                self._token_rejected()
            raise error from exc


__all__ = ["KeepAliveStream"]
