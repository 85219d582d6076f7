"""New bounds without a restart: a job's min/max nodes, followed while its runners run.

A ``PATCH /v1/jobs/{id}`` that changes a job's bounds has the coordinator
rewrite each kept node's assignment *in place*: the same generation, new
``min_nodes``/``max_nodes``, nothing else changed
(:func:`service.scheduler.with_bounds`). An agent restarts a runner only for
a new generation (:mod:`agent.node.daemon`), so the runner and its workers go on;
what must follow the new bounds is the runner's rendezvous, which decides
with them whether a newcomer has room (``max_nodes``) and whether a round can
form (``min_nodes``).

* :func:`rewritten_bounds` is the decision, pure: whether an assignment as
  written now rewrites the one a runner started with in place, and its
  bounds if so. Anything but the bounds differing, or another generation,
  is not a rewrite: that is the daemon's business (it stops the runner).
* :class:`BoundsFollower` watches the node's own assignment key and calls
  ``on_change(min_nodes, max_nodes)`` whenever the assignment at the
  runner's generation carries bounds other than the last ones it reported:
  the runner hands them to its rendezvous handler. Its first report is the
  current value, so a runner started just before a rewrite catches up.

The daemon takes the bounds over in its own bookkeeping once the job's record
confirms them (:mod:`agent.admission`), so a runner it restarts after a crash
starts with them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pydantic import ValidationError

from rendezvous.etcd import EtcdClient, WatchEvent
from rendezvous.records import Assignment
from rendezvous.watch import PrefixWatcher

log = logging.getLogger(__name__)

#: ``on_change(min_nodes, max_nodes)``.
BoundsCallback = Callable[[int, int], None]


def rewritten_bounds(running: Assignment, written: Assignment) -> tuple[int, int] | None:
    """The new bounds if ``written`` rewrites ``running`` in place, else None.

    In place: the same job and generation, other bounds, and every other
    field as it was (the command, the environment, the budget...). An
    assignment that differs in anything else is a new one, which only a new
    generation may bring.

    Args:
        running: the assignment the runner was started with (or last took over).
        written: the assignment as the coordinator wrote it now.

    Returns:
        ``(min_nodes, max_nodes)`` of ``written``, or None.
    """
    bounds = (written.min_nodes, written.max_nodes)
    if bounds == (running.min_nodes, running.max_nodes):
        return None
    same = written.model_copy(update={"min_nodes": running.min_nodes,
                                      "max_nodes": running.max_nodes})
    return bounds if same == running else None


def take_over(running: Assignment, written: Assignment,
              confirmed: Callable[[], bool]) -> Assignment:
    """What the daemon keeps of a rewrite of the assignment a runner runs.

    Args:
        running: the assignment the runner runs (as the daemon knows it).
        written: the assignment at its key now, at the same generation.
        confirmed: whether the job's record says what ``written`` says
            (agent.admission); asked only for a rewrite in place.

    Returns:
        ``running`` with ``written``'s bounds if ``written`` rewrites it in
        place and the record confirms it; else ``running`` unchanged: nothing
        but the bounds is ever taken from a rewrite.
    """
    bounds = rewritten_bounds(running, written)
    if bounds is None or not confirmed():
        return running
    return running.model_copy(update={"min_nodes": bounds[0], "max_nodes": bounds[1]})


def bounds_at(value: bytes, generation: int) -> tuple[int, int] | None:
    """The bounds of the assignment ``value`` holds if it is at ``generation``; None for
    another generation or a value that is not an assignment."""
    try:
        assignment = Assignment.model_validate_json(value)
    except ValidationError:
        return None
    if assignment.generation != generation:
        return None
    return assignment.min_nodes, assignment.max_nodes


class BoundsFollower:
    """Reports the bounds of one node's assignment at one generation as they change.

    Args:
        client: the runner's etcd client.
        key: the node's assignment key (``Keys.assignment(node, job)``).
        generation: the runner's generation; other generations are ignored
            (the agent stops a runner whose generation is replaced).
        on_change: called on the follower's thread with ``(min_nodes,
            max_nodes)``, first with the current bounds, then on each change;
            an exception it raises is logged and the watch goes on.
    """

    def __init__(
        self, client: EtcdClient, key: str, generation: int, *, on_change: BoundsCallback
    ) -> None:
        self.key = key
        self.generation = generation
        self._on_change = on_change
        self._lock = threading.Lock()
        self._last: tuple[int, int] | None = None
        # A prefix watch of one key: ``key`` is also the prefix of other jobs'
        # keys (job "a" of job "ab"); _on_event keeps only its own.
        self._watcher = PrefixWatcher(client, key, on_event=self._on_event,
                                      name=f"bounds of {key}")

    @property
    def bounds(self) -> tuple[int, int] | None:
        """The last bounds reported; None before the first."""
        with self._lock:
            return self._last

    def start(self) -> BoundsFollower:
        self._watcher.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        """Whether the current value was read (and reported) within ``timeout`` seconds."""
        return self._watcher.wait_synced(timeout)

    def stop(self) -> None:
        self._watcher.stop(timeout=5)

    def _on_event(self, event: WatchEvent) -> None:
        if event.key != self.key or event.kind != "put":
            return  # another job's key, or a delete: the agent stops the runner
        bounds = bounds_at(event.value, self.generation)
        with self._lock:
            if bounds is None or bounds == self._last:
                return
            self._last = bounds
        log.info("the assignment at generation %d now has bounds %d..%d",
                 self.generation, *bounds)
        self._on_change(*bounds)
