"""A c10d ``Store`` kept in etcd (:class:`EtcdV3Store`), and how the rendezvous
code rides out an etcd outage: the round stores of the agents' rendezvous
(rendezvous.elastic.assigned) and the store of the torchrun plugin (rendezvous.elastic.etcd_v3).

Every key is written under a lease (``key_ttl``, two hours by default), so an
abandoned store's keys disappear by themselves.
"""

from __future__ import annotations

import builtins
import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.distributed import DistStoreError, Store  # type: ignore[attr-defined]

from rendezvous.errors import EtcdError, EtcdUnavailableError
from rendezvous.etcd import Compare, EtcdClient, Get, KeyValue, Put
from rendezvous.lease import LeaseCache

log = logging.getLogger("rendezvous.elastic.etcd_v3")

GET_AFTER_FIRST_WAIT_S = 10.0  # get_after's watch, before it reads
T = TypeVar("T")

DEFAULT_KEY_TTL_S = 7200
# How long a call keeps retrying while etcd is unreachable before it gives up.
# torch's agent calls the backend from its monitor loop and dies on the first
# error, which would turn an etcd restart into a lost job on every node.
DEFAULT_OUTAGE_GRACE_S = 60.0


def ride_out_outage(
    what: str,
    call: Callable[[float | None], T],
    grace_s: float,
    *,
    call_timeout_s: float | None = None,
) -> T:
    """Run ``call(timeout_s)``; while etcd is unreachable, retry with backoff for ``grace_s``.

    Only for calls that are safe to send again after an expired deadline (a
    timed-out write may have been applied): each caller says why its call is.

    Args:
        what: what the call does, for log lines.
        call: the call; it gets the deadline of the attempt (None: the client's).
        grace_s: how long to keep retrying while etcd does not answer.
        call_timeout_s: the first attempt's deadline; each retry gets twice the
            previous one (the client caps it at its own timeout). A member that
            swallows packets costs one short deadline, after which the client
            has quarantined it and the retry goes to another member; an etcd
            that is merely slow still gets through on a later attempt.

    Raises:
        EtcdUnavailableError: etcd stayed unreachable for ``grace_s`` seconds.
        EtcdError: any other etcd error, at once.
    """
    deadline = time.monotonic() + grace_s
    delay = 0.1
    timeout = call_timeout_s
    while True:
        try:
            return call(timeout)
        except EtcdUnavailableError as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("etcd unreachable during %s (%s); retrying in %.1f s", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            timeout = None if timeout is None else timeout * 2


class EtcdV3Store(Store):
    """A c10d ``Store`` kept in etcd under one prefix.

    Values are stored as raw bytes; keys as given, under ``prefix``. Blocking
    reads (``get``, ``wait``, ``multi_get``) wait on an etcd watch, not by
    polling, until the keys exist or the store's timeout passes, and then
    raise ``torch.distributed.DistStoreError`` as TCPStore does.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        key_ttl_s: int = DEFAULT_KEY_TTL_S,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        outage_grace_s: float = DEFAULT_OUTAGE_GRACE_S,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        if not prefix.endswith("/"):
            raise ValueError(f"store prefix {prefix!r} must end with '/'")
        self._client = client
        self._grace_s = outage_grace_s
        self._prefix = prefix
        self._leases = LeaseCache(client, key_ttl_s)
        self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> str:
        text = key.decode() if isinstance(key, bytes) else str(key)
        return self._prefix + text

    @staticmethod
    def _bytes(value: str | bytes | Sequence[int]) -> bytes:
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        # The store keeps the client's full timeout: it is used while a round
        # forms, not for liveness. Its retries are safe for reads, set and
        # multi_set (the same values again), delete_key and compare_set (a
        # resent swap finds the desired value and returns it). An add whose
        # deadline expired but was applied is counted twice by the retry loop
        # in :meth:`add`; telling our own write from another's needs a marker
        # written with it.
        try:
            return ride_out_outage(what, lambda _timeout_s: call(), self._grace_s)
        except EtcdError as exc:
            raise DistStoreError(f"etcd-v3 store: {what} failed: {exc}") from exc

    # writes ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        data = self._bytes(value)
        self._call(
            f"set {key}",
            lambda: self._leases.with_lease(
                lambda lease: self._client.put(self._key(key), data, lease=lease)
            ),
        )

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:  # type: ignore[override]
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [(self._key(k), self._bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._call(
            "multi_set",
            lambda: self._leases.with_lease(
                lambda lease: self._client.txn(
                    [], success=[Put(k, v, lease=lease) for k, v in puts]
                )
            ),
        )

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """Atomically add ``amount`` to the decimal integer at ``key`` (0 if absent)."""
        full = self._key(key)
        while True:
            kv: KeyValue | None = self._call(f"add {key}", lambda: self._client.get(full))
            current = int(kv.value) if kv is not None else 0
            new = str(current + amount).encode()
            expected = kv.mod_revision if kv is not None else 0
            guard = Compare(full, "mod", "==", expected)

            def write(lease: int, guard: Compare = guard, new: bytes = new) -> Any:
                return self._client.txn([guard], success=[Put(full, new, lease=lease)])

            result = self._call(f"add {key}", lambda: self._leases.with_lease(write))
            if result.succeeded:
                return current + amount

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """TCPStore's semantics: swap if the value equals ``expected_value``.

        An absent key counts as matching an empty ``expected_value``. Returns
        the value the key holds afterwards (or ``expected_value`` when the key
        is absent and ``expected_value`` is not empty, as TCPStore does).
        """
        full = self._key(key)
        expected = self._bytes(expected_value)
        desired = self._bytes(desired_value)
        guard = (
            Compare(full, "create", "==", 0)
            if not expected
            else Compare(full, "value", "==", expected)
        )
        result = self._call(
            f"compare_set {key}",
            lambda: self._leases.with_lease(
                lambda lease: self._client.txn(
                    [guard], success=[Put(full, desired, lease=lease)], failure=[Get(full)]
                )
            ),
        )
        if result.succeeded:
            return desired
        current = result.gets[0]
        return current[0].value if current else expected

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._call(f"delete {key}", lambda: self._client.delete(self._key(key))))

    # reads -----------------------------------------------------------------

    def num_keys(self) -> int:  # type: ignore[override]
        return int(self._call("num_keys", lambda: self._client.count_prefix(self._prefix)))

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        found, _ = self._read(keys)
        return len(found) == len(keys)

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._wait_get([key], None)[0]

    def get_after(self, key: str, revision: int) -> bytes:
        """``get(key)`` for a key known to be put after store revision ``revision``
        (or not yet): one watch from ``revision + 1``, whose event carries the value,
        without the read that ``get`` makes first (which finds nothing when the key
        comes later). Falls back to ``get`` when ``revision`` is 0 (unknown), compacted
        away, or the watch fails.
        """
        if revision > 0:
            store_timeout: datetime.timedelta = self.timeout  # type: ignore[attr-defined]
            # A first wait shorter than the store's: a revision later than the key's put
            # (which the caller's reasoning excludes) costs a read after it, not a hang.
            first = min(store_timeout.total_seconds(), GET_AFTER_FIRST_WAIT_S)
            full = self._key(key)
            try:
                got = self._watch_until({full}, revision + 1, time.monotonic() + first)
            except DistStoreError as exc:
                log.info("etcd-v3 store: watching %s from revision %d failed (%s); reading",
                         key, revision + 1, exc)
            else:
                if full in got:
                    return got[full]
                kv = self._call(f"get {key}", lambda: self._client.get(full))
                if kv is not None:
                    log.warning("etcd-v3 store: %s was not seen by a watch from revision %d "
                                "in %.0f s; it was put at revision %d", key, revision + 1,
                                first, kv.mod_revision)
                    return bytes(kv.value)
        return self.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        return self._wait_get(keys, None)

    def wait(  # type: ignore[override]
        self, keys: list[str], timeout: datetime.timedelta | None = None
    ) -> None:
        self._wait_get(keys, timeout)

    def _read(self, keys: Sequence[str]) -> tuple[dict[str, bytes], int]:
        """One consistent read of ``keys``: what exists, and the revision read at."""
        fulls = [self._key(k) for k in keys]
        result = self._call("read", lambda: self._client.txn([], success=[Get(f) for f in fulls]))
        found = {kvs[0].key: kvs[0].value for kvs in result.gets if kvs}
        return found, result.revision

    def _wait_get(
        self, keys: Sequence[str], timeout: datetime.timedelta | None
    ) -> list[bytes]:
        store_timeout: datetime.timedelta = self.timeout  # type: ignore[attr-defined]
        limit = (timeout if timeout is not None else store_timeout).total_seconds()
        deadline = time.monotonic() + limit
        fulls = [self._key(k) for k in keys]
        while True:
            try:
                found, revision = self._read(keys)
                if len(found) == len(fulls):
                    return [found[f] for f in fulls]
                # The watch's events carry the values: no second read once all came.
                found.update(self._watch_until(set(fulls) - set(found), revision + 1, deadline))
                if len(found) == len(fulls):
                    return [found[f] for f in fulls]
            except DistStoreError as exc:
                # etcd briefly unavailable: keep trying until the deadline.
                if not isinstance(exc.__cause__, EtcdUnavailableError):
                    raise
                time.sleep(0.1)
            if time.monotonic() >= deadline:
                found, _ = self._read(keys)
                if len(found) == len(fulls):
                    return [found[f] for f in fulls]
                missing = sorted(k for k, f in zip(keys, fulls, strict=True) if f not in found)
                raise DistStoreError(
                    f"etcd-v3 store: timed out after {limit:g} s waiting for keys {missing}"
                )

    def _watch_until(
        self, missing: builtins.set[str], start_revision: int, deadline: float
    ) -> dict[str, bytes]:
        """Block until every key in ``missing`` is put, or the deadline passes.

        Returns:
            The keys of ``missing`` put since ``start_revision`` and not deleted
            since, with their latest values (all of them unless the deadline passed).
        """
        got: dict[str, bytes] = {}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return got
        # Watch the keys waited for, not the whole store: one key exactly, several
        # by their longest common prefix.
        one = len(missing) == 1
        first, last = min(missing), max(missing)  # their common prefix is everyone's
        common = next((i for i, (x, y) in enumerate(zip(first, last, strict=False))
                       if x != y), len(first))
        watched = first if one else first[:common]
        try:
            stream = self._client.watch(watched, prefix=not one, start_revision=start_revision)
        except EtcdError as exc:
            raise DistStoreError(f"etcd-v3 store: watch failed: {exc}") from exc
        timer = threading.Timer(remaining, stream.cancel)
        timer.daemon = True
        timer.start()
        try:
            for batch in stream:
                for event in batch.events:
                    if event.key not in missing and event.key not in got:
                        continue  # (another key under the watched prefix)
                    if event.kind == "put":
                        missing.discard(event.key)
                        got[event.key] = event.value
                    else:
                        got.pop(event.key, None)
                        missing.add(event.key)
                if not missing:
                    return got
        except EtcdError as exc:
            raise DistStoreError(f"etcd-v3 store: watch failed: {exc}") from exc
        finally:
            timer.cancel()
            stream.cancel()
        return got


__all__ = ["DEFAULT_KEY_TTL_S", "DEFAULT_OUTAGE_GRACE_S", "EtcdV3Store", "LeaseCache",
           "ride_out_outage"]
