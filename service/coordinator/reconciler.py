"""The reconcile loop: only the elected leader runs it; etcd watches wake it.

Each pass reads one consistent snapshot of etcd (:meth:`JobStore.snapshot`),
asks the pure :func:`service.scheduler.plan` what to change, and writes each
job's change in one transaction (or several, below) that etcd applies only if

* this coordinator still leads (the election's fence: a deposed leader that
  wakes from a pause cannot write), and
* the job record is unchanged since the snapshot (its mod revision), so an API
  write in between (a cancel, a new bound) is never overwritten; the next
  pass sees it.

A change too big for one etcd transaction (over 100 operations or 1 MiB: a job
of 300 nodes, large assignments) is written in several, each under the same
two guards; the order of the writes (:meth:`JobStore.job_ops`) and the
scheduler's generations make a pass cut half-way converge on the next one.

One job's change that etcd refuses for what it is (a request too large, too
many operations, a duplicate key), or that cannot be built, never stops the
pass: it is counted, noted on the job (an event and its ``Scheduled``
condition), and the pass goes on with the other jobs; after
:data:`MAX_JOB_WRITE_FAILURES` passes in a row the job ends ``FAILED``
(:func:`service.scheduler.abandon`). A pass that fails as a whole (etcd
unavailable, a crash) is counted; after :data:`UNREADY_AFTER_FAILED_PASSES` in a
row, :meth:`Reconciler.problem` says so and ``/readyz`` answers 503.

Assignments the coordinator did not write (a job that does not exist, an
invalid record: :class:`service.coordinator.store.StrayAssignment`) are deleted.

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

from rendezvous.election import Election, NotLeaderError
from rendezvous.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    LeaseExpiredError,
)
from rendezvous.etcd import Compare, Delete, Put, WatchEvent
from rendezvous.watch import PrefixWatcher
from service.api.models import EventReason
from service.coordinator.metrics import CoordinatorMetrics
from service.coordinator.store import JobStore, Snapshot, split_ops
from service.scheduler import DEFAULT_POLICY, JobChange, Policy, abandon, note_write_failure, plan

log = logging.getLogger(__name__)

#: Passes in a row in which etcd refused one job's change before the job is failed.
MAX_JOB_WRITE_FAILURES = 3
#: Stray assignments deleted per pass (a flood of them must not make one pass long).
MAX_STRAYS_PER_PASS = 500
#: Failed passes in a row after which /readyz answers 503.
UNREADY_AFTER_FAILED_PASSES = 3
# Errors about etcd or this replica, not about one job's write: they end the pass.
_PASS_ERRORS: tuple[type[Exception], ...] = (
    NotLeaderError, EtcdUnavailableError, EtcdAuthError, EtcdNoSpaceError, LeaseExpiredError,
)
# What etcd (or gRPC) answers when a request itself cannot be applied, whoever
# sends it: only these make an etcd error one job's.
_REQUEST_REFUSALS = (
    "request is too large",
    "too many operations in txn request",
    "duplicate key given in txn request",
    "larger than max",  # gRPC: received message larger than max
)


# The straggler events, by the action counted (tidal_coordinator_stragglers_total).
_STRAGGLER_ACTIONS = {EventReason.STRAGGLER_EVICTED: "evict",
                      EventReason.STRAGGLER_REPORTED: "report"}


def _is_job_error(exc: Exception) -> bool:
    """Whether ``exc`` is about one job's change (its write, or building it), not etcd."""
    if isinstance(exc, EtcdError):
        return not isinstance(exc, _PASS_ERRORS) and any(
            refusal in str(exc) for refusal in _REQUEST_REFUSALS
        )
    return True


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Reconciler:
    """Runs :func:`plan` whenever something changed, while this replica leads.

    Args:
        store: the coordinator's etcd access.
        election: this replica's candidacy; the loop campaigns in its own thread.
        metrics: where to count passes and decisions.
        interval_s: the longest time between two passes.
        batch_s: how long a wake-up waits for more events before a pass.
        min_pass_interval_s: the least time from one pass's start to the next's.
        policy: the scheduler's tunables (the stragglers' cool-down among them).
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
        policy: Policy = DEFAULT_POLICY,
    ) -> None:
        self.store = store
        self.policy = policy
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
        self.failed_passes = 0  # in a row
        self.last_pass_error = ""
        self.last_success: datetime | None = None
        # job -> (passes in a row its write failed, the last error)
        self._job_failures: dict[str, tuple[int, str]] = {}

    def start(self) -> Reconciler:
        keys = self.store.keys
        for prefix in (keys.jobs_prefix(), keys.nodes_prefix(), keys.drains_prefix(),
                       keys.assignments_prefix(), keys.status_prefix(), keys.queues_prefix()):
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
        node = self.store.keys.node_of(event.key)
        if event.kind == "delete" and node is not None:
            self.metrics.node_departed(node, event.mod_revision)
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

    # health ----------------------------------------------------------------------------

    def _pass_failed(self, exc: Exception) -> None:
        self.failed_passes += 1
        self.last_pass_error = _short(exc)
        self.metrics.reconcile_failures.inc()
        self.metrics.reconcile_consecutive_failures.set(self.failed_passes)

    def _pass_succeeded(self) -> None:
        self.failed_passes = 0
        self.last_success = datetime.now(timezone.utc)
        self.metrics.reconcile_consecutive_failures.set(0)
        self.metrics.reconcile_last_success.set(self.last_success.timestamp())

    def problem(self) -> str | None:
        """Why this replica's reconciling is unhealthy (for /readyz), or None."""
        if self.failed_passes < UNREADY_AFTER_FAILED_PASSES:
            return None
        since = self.last_success.isoformat() if self.last_success else "never on this replica"
        return (f"the last {self.failed_passes} reconcile passes failed "
                f"(last success: {since}): {self.last_pass_error}")

    def reconcile_once(self) -> int:
        """One pass: snapshot, plan, write. Returns the number of job changes written.

        A job whose write etcd refuses is recorded (:meth:`_job_write_failed`)
        and the pass goes on with the others.

        Raises:
            NotLeaderError: this replica was deposed; nothing more was written.
            EtcdError: etcd failed; the next pass starts over.
        """
        try:
            written = self._reconcile()
        except NotLeaderError:
            raise
        except Exception as exc:
            self._pass_failed(exc)
            raise
        self._pass_succeeded()
        return written

    def _reconcile(self) -> int:
        started = time.perf_counter()
        snap = self.store.snapshot()
        self.last_snapshot = snap
        self.metrics.observe_snapshot(snap)
        now = datetime.now(timezone.utc)
        changes = plan(snap.view, now, self.policy)
        live = {j for j, r in snap.view.jobs.items() if not r.phase.is_terminal()}
        self._job_failures = {j: f for j, f in self._job_failures.items() if j in live}
        written = 0
        for change in changes:
            failures, error = self._job_failures.get(change.job_id, (0, ""))
            give_up = failures >= MAX_JOB_WRITE_FAILURES
            if give_up:
                change = abandon(snap.view, change.job_id, error, now)
            try:
                done = self._apply(snap, change)
            except Exception as exc:
                if not _is_job_error(exc):
                    raise
                self._job_write_failed(snap, change, exc, now)
                continue
            if done:
                written += 1
                self._job_failures.pop(change.job_id, None)
                if give_up:
                    self.metrics.jobs_abandoned.inc()
        self._delete_strays(snap)
        self.passes += 1
        self.metrics.reconcile_duration.observe(time.perf_counter() - started)
        if written:
            self._wake.set()  # look again: statuses may already have moved on
        return written

    def _job_write_failed(
        self, snap: Snapshot, change: JobChange, exc: Exception, now: datetime
    ) -> None:
        """Count a refused write; note the first on the job; wake soon to try (or give up)."""
        job_id = change.job_id
        failures = self._job_failures.get(job_id, (0, ""))[0] + 1
        error = _short(exc)
        self._job_failures[job_id] = (failures, error)
        self.metrics.job_write_failures.inc()
        log.warning("job %s: etcd refused its change (%d of %d before it fails): %s",
                    job_id, failures, MAX_JOB_WRITE_FAILURES, error)
        if failures == 1:
            note = note_write_failure(snap.view, job_id, error, failures,
                                      MAX_JOB_WRITE_FAILURES, now)
            try:
                self._apply(snap, note)
            except Exception as note_exc:
                if not _is_job_error(note_exc):
                    raise
                log.warning("job %s: could not note the failure either: %s", job_id, note_exc)
        if failures <= MAX_JOB_WRITE_FAILURES:
            self._wake.set()

    def _delete_strays(self, snap: Snapshot) -> None:
        """Delete the assignments no job of this coordinator owns (compared on their revision)."""
        for stray in snap.strays[:MAX_STRAYS_PER_PASS]:
            guard = [Compare(stray.key, "mod", "==", stray.mod_revision)]
            try:
                deleted = self.election.fenced_txn(guard, [Delete(stray.key)]).succeeded
            except _PASS_ERRORS:
                raise
            except EtcdError as exc:
                log.warning("could not delete the stray assignment %s: %s", stray.key, exc)
                continue
            if deleted:
                self.metrics.strays_deleted.inc()
                log.warning("deleted the assignment %s, which the coordinator did not write: %s",
                            stray.key, stray.why)

    def _apply(self, snap: Snapshot, change: JobChange) -> bool:
        """Write one job's change, in as many fenced transactions as it needs.

        Every transaction compares the job record's mod revision with the one
        the pass planned from (and, once this change wrote the record, with
        that write's): a change by the API in between stops the rest, and the
        next pass decides again from what was written.
        """
        keys = self.store.keys
        job_key = keys.job(change.job_id)
        revision = snap.job_revisions[change.job_id]
        ops = self.store.job_ops(
            change.record, put=change.put, delete=change.delete, events=change.events,
            slow=change.slow,
        )
        batches = split_ops(ops)
        for batch in batches:
            result = self.election.fenced_txn([Compare(job_key, "mod", "==", revision)], batch)
            if not result.succeeded:
                log.info("job %s changed under the pass; the next pass decides again",
                         change.job_id)
                return False
            if any(isinstance(op, Put) and op.key == job_key for op in batch):
                revision = result.revision
        if len(batches) > 1:
            log.info("job %s: change of %d operations written in %d transactions",
                     change.job_id, len(ops), len(batches))
        self.metrics.decisions.labels(action="assign").inc(len(change.put))
        self.metrics.decisions.labels(action="release").inc(len(change.delete))
        before = snap.view.jobs.get(change.job_id)
        if before is not None and before.first_step_at is None:
            self.metrics.observe_first_step(change.record)
        for event in change.events:
            log.info("job %s: %s (%s)", change.job_id, event.message, event.reason.value)
            action = _STRAGGLER_ACTIONS.get(event.reason)
            if action is not None:
                self.metrics.stragglers.labels(action=action).inc()
        return True
