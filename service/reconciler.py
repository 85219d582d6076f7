"""The reconcile loop: only the elected leader runs it; etcd watches wake it.

Each pass reads one consistent snapshot of etcd (:meth:`JobStore.snapshot`),
asks the pure :func:`service.scheduler.plan` what to change, and writes each
job's change in one transaction that etcd applies only if

* this coordinator still leads (the election's fence: a deposed leader that
  wakes from a pause cannot write), and
* the job record is unchanged since the snapshot (its mod revision), so an API
  write in between (a cancel, a new bound) is never overwritten; the next
  pass sees it.

Watches on jobs, nodes, drains, assignments and statuses wake the loop at once
(debounced by ``batch_s``, at most one pass per ``min_pass_interval_s``); a
periodic pass every ``interval_s`` covers the rest. The loop is
level-triggered: a missed wake-up costs latency, never correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone

from rendezvous.client import Compare, WatchEvent
from rendezvous.election import Election, NotLeaderError
from rendezvous.errors import EtcdError
from rendezvous.watch import PrefixWatcher
from service.metrics import CoordinatorMetrics
from service.scheduler import JobChange, plan
from service.store import JobStore, Snapshot

log = logging.getLogger(__name__)


class Reconciler:
    """Runs :func:`plan` whenever something changed, while this replica leads.

    Args:
        store: the coordinator's etcd access.
        election: this replica's candidacy; the loop campaigns in its own thread.
        metrics: where to count passes and decisions.
        interval_s: the longest time between two passes.
        batch_s: how long a wake-up waits for more events before a pass.
        min_pass_interval_s: the least time from one pass's start to the next's.
    """

    def __init__(
        self,
        store: JobStore,
        election: Election,
        metrics: CoordinatorMetrics,
        *,
        interval_s: float = 2.0,
        batch_s: float = 0.02,
        min_pass_interval_s: float = 0.2,
    ) -> None:
        self.store = store
        self.election = election
        self.metrics = metrics
        self.interval_s = interval_s
        self.batch_s = batch_s
        self.min_pass_interval_s = min_pass_interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watchers: list[PrefixWatcher] = []
        self.last_snapshot: Snapshot | None = None
        self.passes = 0

    def start(self) -> Reconciler:
        keys = self.store.keys
        for prefix in (keys.jobs_prefix(), keys.nodes_prefix(), keys.drains_prefix(),
                       keys.assignments_prefix(), keys.status_prefix()):
            self._watchers.append(
                PrefixWatcher(self.store.client, prefix, on_event=self._on_event,
                              name=f"coordinator watch {prefix}").start()
            )
        for target, name in ((self._campaign, "campaign"), (self._loop, "reconcile")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for watcher in self._watchers:
            watcher.stop(timeout=5)
        for thread in self._threads:
            thread.join(timeout=10)
        self.election.resign()

    def wake(self) -> None:
        self._wake.set()

    def _on_event(self, event: WatchEvent) -> None:
        prefix = self.store.keys.nodes_prefix()
        if event.kind == "delete" and event.key.startswith(prefix):
            self.metrics.node_departed(event.key.removeprefix(prefix), event.mod_revision)
        self._wake.set()

    # leadership ------------------------------------------------------------------------

    def _campaign(self) -> None:
        """Stand for election until elected; stand again after losing the lease."""
        while not self._stop.is_set():
            if self.election.is_leader:
                self.metrics.leader.set(1)
                self._stop.wait(0.2)
                continue
            self.metrics.leader.set(0)
            try:
                self.election.campaign(timeout=5.0)
            except TimeoutError:
                continue
            except EtcdError as exc:
                self.metrics.etcd_errors.labels(op="campaign").inc()
                log.warning("campaign failed (%s); retrying", exc)
                self._stop.wait(1.0)
                continue
            log.info("this coordinator leads (%s)", self.election.key)
            self.metrics.leader.set(1)
            self._wake.set()
        self.metrics.leader.set(0)

    # the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        last_pass = last_duration = 0.0
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            if self._stop.is_set():
                return
            # Let a burst of events arrive, and leave the API some CPU between
            # passes under a stream of writes: one pass serves them all.
            # A pass that took long (a big cluster) buys a longer pause, so that
            # reconciling never takes more than about a fifth of the CPU.
            gap = max(self.min_pass_interval_s, 4 * last_duration)
            pause = max(self.batch_s, last_pass + gap - time.monotonic())
            if pause > 0 and self._stop.wait(pause):
                return
            last_pass = time.monotonic()
            self._wake.clear()
            if not self.election.is_leader:
                continue
            try:
                self.reconcile_once()
                last_duration = time.monotonic() - last_pass
            except NotLeaderError as exc:
                log.warning("lost leadership mid-pass: %s", exc)
            except EtcdError as exc:
                self.metrics.etcd_errors.labels(op="reconcile").inc()
                log.warning("reconcile pass failed (%s); retrying", exc)
                self._stop.wait(0.5)
                self._wake.set()
            except Exception:
                log.exception("reconcile pass crashed; retrying")
                self._stop.wait(1.0)
                self._wake.set()

    def reconcile_once(self) -> int:
        """One pass: snapshot, plan, write. Returns the number of job changes written.

        Raises:
            NotLeaderError: this replica was deposed; nothing more was written.
            EtcdError: etcd failed; the next pass starts over.
        """
        started = time.perf_counter()
        snap = self.store.snapshot()
        self.last_snapshot = snap
        self.metrics.observe_snapshot(snap)
        changes = plan(snap.view, datetime.now(timezone.utc))
        written = 0
        for change in changes:
            if self._apply(snap, change):
                written += 1
        self.passes += 1
        self.metrics.reconcile_duration.observe(time.perf_counter() - started)
        if written:
            self._wake.set()  # look again: statuses may already have moved on
        return written

    def _apply(self, snap: Snapshot, change: JobChange) -> bool:
        keys = self.store.keys
        job_key = keys.job(change.job_id)
        guard = [Compare(job_key, "mod", "==", snap.job_revisions[change.job_id])]
        ops = self.store.job_ops(
            change.record, put=change.put, delete=change.delete, events=change.events
        )
        result = self.election.fenced_txn(guard, ops)
        if not result.succeeded:
            log.info("job %s changed under the pass; the next pass decides again", change.job_id)
            return False
        self.metrics.decisions.labels(action="assign").inc(len(change.put))
        self.metrics.decisions.labels(action="release").inc(len(change.delete))
        for event in change.events:
            log.info("job %s: %s (%s)", change.job_id, event.message, event.reason.value)
        return True
