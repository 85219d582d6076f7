"""Watch every key under a prefix, and keep watching through etcd's failures.

:class:`PrefixWatcher` is a list-then-watch loop in the style of a Kubernetes
informer, and what the coordinator and the agents use for every watch:

1. list the prefix (one range read, which also gives the store revision R),
   deliver what changed since the cached snapshot (at first: everything, as
   ``put`` events), and mark the watcher synced;
2. watch the prefix from R + 1 and deliver each event in order, keeping the
   snapshot up to date;
3. when the watch fails (etcd unreachable or restarted: ``EtcdUnavailableError``;
   history compacted past the revision it needs: ``EtcdCompactedError``; any
   other etcd error), back off and go to 1. The new listing is diffed against
   the snapshot and the difference is delivered as synthetic events, so the
   consumer sees every key that appeared, changed or vanished while the
   watcher was blind. A key deleted and re-created while blind is delivered
   as a ``delete`` followed by a ``put``.

Intermediate values a key took while the watcher was blind are not replayed:
consumers must treat events as "the latest state of this key", never as a log.

Callbacks run on the watcher's thread, one at a time, in order. A callback that
raises is logged and the watch goes on: one bad consumer must not blind the
others (python-etcd3's watcher drops the watch instead).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from rendezvous.errors import EtcdCompactedError, EtcdError
from rendezvous.etcd import EtcdClient, KeyValue, WatchEvent, WatchStream

log = logging.getLogger(__name__)

EventCallback = Callable[[WatchEvent], None]


def _as_event(kind: str, kv: KeyValue, *, revision: int) -> WatchEvent:
    """A synthetic event for a key seen (``put``) or missed (``delete``) by a listing."""
    if kind == "put":
        return WatchEvent(
            kind="put",
            key=kv.key,
            value=kv.value,
            mod_revision=kv.mod_revision,
            create_revision=kv.create_revision,
            lease=kv.lease,
            version=kv.version,
        )
    return WatchEvent(
        kind="delete",
        key=kv.key,
        value=b"",
        mod_revision=revision,
        create_revision=0,
        lease=0,
        version=0,
    )


def diff_snapshots(
    old: dict[str, KeyValue], new: dict[str, KeyValue], *, revision: int
) -> list[WatchEvent]:
    """The events that turn ``old`` into ``new``, ordered by key.

    Args:
        old: the cached snapshot.
        new: a fresh listing.
        revision: the store revision of the fresh listing (the synthetic
            deletes' ``mod_revision``).

    Returns:
        ``delete`` for keys gone, ``put`` for keys new or changed, and
        ``delete`` then ``put`` for keys deleted and re-created.
    """
    events: list[WatchEvent] = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key), new.get(key)
        if after is None:
            assert before is not None
            events.append(_as_event("delete", before, revision=revision))
        elif before is None:
            events.append(_as_event("put", after, revision=revision))
        elif before.create_revision != after.create_revision:
            events.append(_as_event("delete", before, revision=revision))
            events.append(_as_event("put", after, revision=revision))
        elif before.mod_revision != after.mod_revision:
            events.append(_as_event("put", after, revision=revision))
    return events


class PrefixWatcher:
    """List-then-watch one prefix in a thread, re-listing after every failure.

    Args:
        client: the process's etcd client.
        prefix: the key prefix to follow (end it with ``/``).
        on_event: called with each event, in order, on the watcher's thread.
        name: what is watched, for log lines and the thread name.
        backoff_initial_s / backoff_max_s: the wait before re-listing after a
            failure, doubling from the first to the second.
        resume: ``(keys, revision)``: the prefix as the caller knows it at store
            revision ``revision`` (from a record another process wrote; synthetic
            ``create_revision`` 0 is fine): the first listing is skipped, those keys
            are delivered as ``put`` events and the watch starts at ``revision + 1``.
            A failure after that (a compacted revision included) re-lists as usual,
            and the diff delivers the keys as they really are.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        on_event: EventCallback,
        name: str | None = None,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        resume: tuple[list[KeyValue], int] | None = None,
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(
                f"backoff_initial_s ({backoff_initial_s}) must be > 0 and "
                f"<= backoff_max_s ({backoff_max_s})"
            )
        self._client = client
        self.prefix = prefix
        self._on_event = on_event
        self.name = name or f"watch {prefix}"
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._lock = threading.Lock()
        self._snapshot: dict[str, KeyValue] = {}
        self._revision = 0
        self._stream: WatchStream | None = None
        self._stopped = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self._resume = resume
        self.relists = 0  # listings after the first: each one a recovery
        self.callback_errors = 0

    # public API --------------------------------------------------------------

    def start(self) -> PrefixWatcher:
        """Start the watcher's thread; returns ``self``.

        Raises:
            RuntimeError: the watcher was already started.
        """
        # Under the lock: stop() in another thread reads the thread under it too, and must
        # never find one assigned but not yet started (joining that raises).
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"{self.name}: the watcher was already started")
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            thread.start()
            self._thread = thread
        return self

    def wait_synced(self, timeout: float) -> bool:
        """Block until the first listing has been delivered; False on timeout."""
        return self._synced.wait(timeout)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def revision(self) -> int:
        """The store revision the snapshot reflects."""
        with self._lock:
            return self._revision

    def snapshot(self) -> dict[str, KeyValue]:
        """A copy of the current view: key -> :class:`KeyValue`."""
        with self._lock:
            return dict(self._snapshot)

    def stop(self, timeout: float | None = None) -> None:
        """Stop watching and wait for the thread to end.

        Args:
            timeout: how long to wait for the thread; by default the client's
                timeout plus a second (a listing in flight is not interruptible).
        """
        self._stopped.set()
        with self._lock:
            stream, thread = self._stream, self._thread
        if stream is not None:
            stream.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._client.config.timeout_s + 1 if timeout is None else timeout)
            if thread.is_alive():
                log.warning("%s: the watcher thread did not end in time", self.name)

    def __enter__(self) -> PrefixWatcher:
        return self.start() if self._thread is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # the watcher thread ---------------------------------------------------------

    def _run(self) -> None:
        backoff = self._backoff_initial
        while not self._stopped.is_set():
            try:
                resume, self._resume = self._resume, None
                if resume is None:
                    self._list()
                else:
                    self._start_from(*resume)
                self._watch()
                backoff = self._backoff_initial  # a clean end: re-list at once
            except EtcdCompactedError as exc:
                log.warning("%s: history compacted (%s); re-listing", self.name, exc)
                backoff = self._backoff_initial  # etcd answers; no reason to wait
            except EtcdError as exc:
                if self._stopped.is_set():
                    break
                log.warning(
                    "%s: watch failed (%s: %s); re-listing in %.1f s",
                    self.name,
                    type(exc).__name__,
                    exc,
                    backoff,
                )
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max)
            except Exception:
                log.exception("%s: the watcher failed unexpectedly; re-listing", self.name)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max)
        log.debug("%s: stopped", self.name)

    def _list(self) -> None:
        kvs, revision = self._client.get_prefix(self.prefix)
        listing = {kv.key: kv for kv in kvs}
        with self._lock:
            events = diff_snapshots(self._snapshot, listing, revision=revision)
        if self._synced.is_set():
            self.relists += 1
            log.info(
                "%s: re-listed at revision %d: %d change(s) while blind",
                self.name,
                revision,
                len(events),
            )
        for event in events:
            if self._stopped.is_set():
                return
            self._apply(event)
        with self._lock:
            self._revision = revision
        self._synced.set()

    def _start_from(self, kvs: list[KeyValue], revision: int) -> None:
        for kv in kvs:
            if self._stopped.is_set():
                return
            self._apply(_as_event("put", kv, revision=revision))
        with self._lock:
            self._revision = revision
        self._synced.set()

    def _watch(self) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            stream = self._client.watch(self.prefix, prefix=True, start_revision=self._revision + 1)
            self._stream = stream
        try:
            for batch in stream:
                for event in batch.events:
                    self._apply(event)
                with self._lock:
                    if batch.events:
                        self._revision = max(self._revision, batch.events[-1].mod_revision)
                    else:  # a progress notification: nothing missed up to here
                        self._revision = max(self._revision, batch.revision)
        finally:
            stream.cancel()
            with self._lock:
                self._stream = None

    def _apply(self, event: WatchEvent) -> None:
        with self._lock:
            if event.kind == "put":
                self._snapshot[event.key] = KeyValue(
                    key=event.key,
                    value=event.value,
                    create_revision=event.create_revision,
                    mod_revision=event.mod_revision,
                    version=event.version,
                    lease=event.lease,
                )
            else:
                self._snapshot.pop(event.key, None)
        try:
            self._on_event(event)
        except Exception:
            self.callback_errors += 1
            log.exception(
                "%s: the callback raised on %s %s; the watch goes on",
                self.name,
                event.kind,
                event.key,
            )
