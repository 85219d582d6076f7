"""One etcd watch as a plain iterator: :class:`WatchStream`.

pyetcd's callback watcher drops every watch on a connection error and only
logs callback exceptions. A :class:`WatchStream` is iterated by its consumer;
it ends when cancelled and raises :class:`~rendezvous.errors.EtcdCompactedError`
or :class:`~rendezvous.errors.EtcdUnavailableError` when it can no longer deliver
every event. :mod:`rendezvous.watch` builds list-then-watch with reconnects on
top of it. The facade opens it (:meth:`rendezvous.etcd.facade.EtcdClient.watch`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from rendezvous.errors import EtcdCompactedError, EtcdError, EtcdUnavailableError
from rendezvous.etcd.messages import watch_batch
from rendezvous.etcd.types import WatchBatch


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
                yield watch_batch(resp)
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


__all__ = ["WatchStream"]
