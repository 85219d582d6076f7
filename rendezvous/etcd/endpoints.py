"""Which etcd endpoint the next call goes to: :class:`EndpointPicker` (no I/O).

pyetcd marks an endpoint "failed" for 300 s after one error and, without
failover, refuses to use it again until then: an etcd restart would make the
client useless for five minutes. With failover it marks whichever endpoint is
current when an error comes back, not the one the failed call went to, so with
several threads a healthy member gets the blame. The picker decides instead: a
member that refused a call is skipped for 2 s, one that did not answer in time
(cut off, paused) for 10 s and longer while it stays silent, and no endpoint is
ever refused outright.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from rendezvous.etcd import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

# How long an endpoint is skipped after a call to it failed. A refused
# connection is what a restarting member looks like: try it again soon. No
# answer at all within the deadline is what a member cut off from the network
# (or paused) looks like; every call sent to it costs a whole deadline, so stay
# away longer, and longer still while it keeps failing that way.
REFUSED_QUARANTINE_S = 2.0
SILENT_QUARANTINE_S = 10.0
MAX_QUARANTINE_S = 60.0


class EndpointPicker:
    """Decides which etcd endpoint the next call goes to. Thread-safe; no I/O.

    Calls stick to the current endpoint while it answers. When a call fails,
    the endpoint *that call went to* is quarantined (another thread may have
    moved on already; blaming the current one would punish a healthy member),
    and the next call goes to the next endpoint in order that is not
    quarantined. If every endpoint is, the one whose quarantine ends first is
    used: the picker never refuses to try, so a client whose members all
    failed at once (an etcd restart, this host's network down) works again as
    soon as one answers. With a single endpoint nothing is ever quarantined.

    Args:
        endpoints: the endpoints' labels (``host:port``), in failover order.
        first: where calls go until one fails; the first of ``endpoints`` by default.
        clock: monotonic seconds; injectable for tests.

    Raises:
        ValueError: no endpoints, or ``first`` is not one of them.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        first: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not endpoints:
            raise ValueError("EndpointPicker needs at least one endpoint")
        self._order = list(dict.fromkeys(endpoints))
        if first is not None and first not in self._order:
            raise ValueError(f"first endpoint {first!r} is not one of {self._order}")
        self._current = self._order[0] if first is None else first
        self._bad_until = dict.fromkeys(self._order, 0.0)
        self._silences = dict.fromkeys(self._order, 0)  # deadlines missed in a row
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        """The endpoint calls go to now (as of the last :meth:`pick`)."""
        return self._current

    def quarantined_for(self, endpoint: str) -> float:
        """Seconds until ``endpoint`` may be picked again (0 if it may now)."""
        with self._lock:
            return max(0.0, self._bad_until[endpoint] - self._clock())

    def pick(self) -> str:
        """The endpoint for the next call (the current one, unless it is quarantined)."""
        with self._lock:
            now = self._clock()
            if self._bad_until[self._current] <= now:
                return self._current
            start = self._order.index(self._current)
            ring = self._order[start + 1 :] + self._order[: start + 1]
            usable = [e for e in ring if self._bad_until[e] <= now]
            chosen = usable[0] if usable else min(ring, key=lambda e: self._bad_until[e])
            if chosen != self._current:
                log.info(
                    "etcd: calls go to %s now; %s is skipped for %.1f s",
                    chosen,
                    self._current,
                    self._bad_until[self._current] - now,
                )
                self._current = chosen
            return chosen

    def failed(self, endpoint: str, *, silent: bool) -> None:
        """A call to ``endpoint`` failed: it was refused, or (``silent``) got no answer in time."""
        if len(self._order) < 2 or endpoint not in self._bad_until:
            return
        with self._lock:
            if silent:
                self._silences[endpoint] += 1
                doublings = min(self._silences[endpoint] - 1, 8)
                pause = min(SILENT_QUARANTINE_S * 2**doublings, MAX_QUARANTINE_S)
            else:
                pause = REFUSED_QUARANTINE_S
            self._bad_until[endpoint] = max(self._bad_until[endpoint], self._clock() + pause)

    def answered(self, endpoint: str) -> None:
        """A call to ``endpoint`` got an answer: whatever was held against it is forgotten."""
        if endpoint not in self._bad_until:
            return
        with self._lock:
            self._bad_until[endpoint] = 0.0
            self._silences[endpoint] = 0


__all__ = ["MAX_QUARANTINE_S", "REFUSED_QUARANTINE_S", "SILENT_QUARANTINE_S", "EndpointPicker"]
