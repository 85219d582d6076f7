"""The coordinator's reads and writes of etcd: jobs, their events, drains, and snapshots.

Every write of a job record compares on the record's mod revision, so two
writers (the API on any replica, the leader's reconcile loop) never lose each
other's changes: the loser re-reads and tries again. A job's events are
appended in the same transaction as the record change they describe.

Parsed records are cached by (key, mod revision): a snapshot of 2,000 jobs
parses only what changed since the last one.

etcd refuses a request over 1.5 MiB and a transaction of more than 128
operations. :func:`split_job_ops` cuts a job's change into transactions of at
most :data:`MAX_TXN_OPS` operations and :data:`MAX_TXN_BYTES` bytes, so a job of
300 nodes, or one whose assignments are large, is written in several.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from rendezvous.etcd import Compare, Delete, EtcdClient, Get, KeyValue, Put, TxnOp
from rendezvous.keys import Keys
from rendezvous.records import Assignment, JobNodeStatus
from rendezvous.registry import NodeInfo
from service.api.models import JobEvent, JobRecord, SlowMark
from service.api.queues import QueueSpec
from service.scheduler import ClusterView

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
MAX_CAS_ATTEMPTS = 20
#: Operations in one transaction: etcd's default --max-txn-ops is 128; the
#: leader's fence adds its compares and a Get of its own.
MAX_TXN_OPS = 100
#: Bytes of keys and values in one transaction: etcd's default
#: --max-request-bytes is 1.5 MiB; the rest is room for compares and framing.
MAX_TXN_BYTES = 1 << 20
_OP_OVERHEAD = 32  # protobuf framing of one operation, generously


class JobNotFoundError(LookupError):
    """No job has this id."""


class StateConflictError(RuntimeError):
    """The change is not allowed in the job's current state (HTTP 409)."""


@dataclass(frozen=True)
class StrayAssignment:
    """A record under ``assignments/`` that the coordinator did not write (or no longer owns).

    Its key names no valid node and job, its body is not an assignment or
    names another job, or its job does not exist (an assignment put by hand).
    """

    key: str
    mod_revision: int
    why: str


@dataclass(frozen=True)
class Snapshot:
    """Everything under the coordinator's prefixes at one etcd revision.

    ``view.assignments`` holds only the valid assignments of existing jobs;
    the rest are in ``strays``.
    """

    revision: int
    view: ClusterView
    job_revisions: dict[str, int]  # job id -> mod revision of its record
    strays: tuple[StrayAssignment, ...] = ()


def _op_size(op: TxnOp) -> int:
    value = op.value if isinstance(op, Put) else b""
    return len(op.key.encode()) + len(value) + _OP_OVERHEAD


def split_ops(
    ops: Sequence[TxnOp], *, max_ops: int = MAX_TXN_OPS, max_bytes: int = MAX_TXN_BYTES
) -> list[list[TxnOp]]:
    """Cut ``ops`` into consecutive groups of at most ``max_ops`` and about ``max_bytes``.

    Order is kept. An operation bigger than ``max_bytes`` on its own gets a
    group of its own (etcd may still refuse it: the caller records that).
    """
    groups: list[list[TxnOp]] = []
    current: list[TxnOp] = []
    size = 0
    for op in ops:
        n = _op_size(op)
        if current and (len(current) >= max_ops or size + n > max_bytes):
            groups.append(current)
            current, size = [], 0
        current.append(op)
        size += n
    if current:
        groups.append(current)
    return groups


class _ParseCache:
    """Parsed models by key, reused while the key's mod revision is unchanged."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, BaseModel | None]] = {}

    def parse(self, kvs: Iterable[KeyValue], model: type[M]) -> dict[str, M]:
        out: dict[str, M] = {}
        seen: dict[str, tuple[int, BaseModel | None]] = {}
        for kv in kvs:
            hit = self._cache.get(kv.key)
            if hit is not None and hit[0] == kv.mod_revision:
                parsed = hit[1]
            else:
                try:
                    parsed = model.model_validate_json(kv.value)
                except ValidationError as exc:
                    log.warning("ignoring the invalid record at %s: %s", kv.key, exc)
                    parsed = None
            seen[kv.key] = (kv.mod_revision, parsed)
            if isinstance(parsed, model):
                out[kv.key] = parsed
        self._cache.update(seen)
        return out

    def forget_except(self, keys: set[str]) -> None:
        for key in set(self._cache) - keys:
            del self._cache[key]


class JobStore:
    """Jobs, events, drains and cluster snapshots in etcd.

    Args:
        client: the coordinator's etcd client.
    """

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.keys = client.keys
        self._cache = _ParseCache()

    # jobs ------------------------------------------------------------------------------

    def create(self, record: JobRecord, event: JobEvent) -> None:
        """Store a new job and its first event.

        Raises:
            StateConflictError: a job with this id exists.
        """
        key = self.keys.job(record.job_id)
        result = self.client.txn(
            [Compare(key, "version", "==", 0)],
            [Put(key, record.model_dump_json().encode()), self._event_put(record.job_id, event)],
        )
        if not result.succeeded:
            raise StateConflictError(f"a job with id {record.job_id} exists")

    def get(self, job_id: str) -> tuple[JobRecord, int]:
        """The job's record and its mod revision.

        Raises:
            JobNotFoundError: no such job.
        """
        kv = self.client.get(self.keys.job(job_id))
        if kv is None:
            raise JobNotFoundError(f"job {job_id} does not exist")
        return JobRecord.model_validate_json(kv.value), kv.mod_revision

    def list_jobs(self) -> list[JobRecord]:
        kvs, _ = self.client.get_prefix(self.keys.jobs_prefix())
        return list(self._cache.parse(kvs, JobRecord).values())

    def update(
        self,
        job_id: str,
        mutate: Callable[[JobRecord], Sequence[JobEvent]],
    ) -> JobRecord:
        """Change a job with compare-and-set, retrying when another writer got there first.

        Args:
            job_id: the job.
            mutate: changes the record in place and returns the events to append;
                may raise :class:`StateConflictError` to refuse.

        Returns:
            The record as written.

        Raises:
            JobNotFoundError: no such job.
            StateConflictError: ``mutate`` refused, or the record kept changing.
        """
        for _ in range(MAX_CAS_ATTEMPTS):
            record, revision = self.get(job_id)
            events = mutate(record)
            key = self.keys.job(job_id)
            ops: list[TxnOp] = [Put(key, record.model_dump_json().encode())]
            ops += [self._event_put(job_id, e) for e in events]
            if self.client.txn([Compare(key, "mod", "==", revision)], ops).succeeded:
                return record
        raise StateConflictError(f"job {job_id} kept changing; try again")

    def events(self, job_id: str) -> list[JobEvent]:
        kvs, _ = self.client.get_prefix(self.keys.job_events_prefix(job_id))
        out = []
        for kv in kvs:
            try:
                out.append(JobEvent.model_validate_json(kv.value))
            except ValidationError as exc:
                log.warning("ignoring the invalid event at %s: %s", kv.key, exc)
        return sorted(out, key=lambda e: e.seq)

    def _event_put(self, job_id: str, event: JobEvent) -> Put:
        return _event_put(self.keys, job_id, event)

    def job_ops(
        self,
        record: JobRecord,
        *,
        put: dict[str, Assignment],
        delete: Iterable[str],
        events: Iterable[JobEvent],
        slow: Mapping[str, SlowMark] | None = None,
    ) -> list[TxnOp]:
        """The operations that write a job's record, assignments and events; see :func:`job_ops`."""
        return job_ops(self.keys, record, put=put, delete=delete, events=events, slow=slow)

    # per-job observations ----------------------------------------------------------------

    def statuses(self, job_id: str) -> dict[str, JobNodeStatus]:
        kvs, _ = self.client.get_prefix(self.keys.job_status_prefix(job_id))
        return {s.node_id: s for s in self._cache.parse(kvs, JobNodeStatus).values()}

    def all_statuses(self) -> dict[str, dict[str, JobNodeStatus]]:
        """Every job's node reports: job -> node -> status."""
        kvs, _ = self.client.get_prefix(self.keys.status_prefix())
        out: dict[str, dict[str, JobNodeStatus]] = {}
        for st in self._cache.parse(kvs, JobNodeStatus).values():
            out.setdefault(st.job_id, {})[st.node_id] = st
        return out

    # nodes and drains --------------------------------------------------------------------

    def nodes(self) -> dict[str, NodeInfo]:
        kvs, _ = self.client.get_prefix(self.keys.nodes_prefix())
        return {n.node_id: n for n in self._cache.parse(kvs, NodeInfo).values()}

    def drains(self) -> set[str]:
        kvs, _ = self.client.get_prefix(self.keys.drains_prefix())
        return {node for kv in kvs if (node := self.keys.drained_node(kv.key)) is not None}

    def set_drain(self, node_id: str, draining: bool) -> None:
        """Drain the node, or put it back in service: an undrain also clears its
        ``slow`` mark (a straggler's cool-down)."""
        key = self.keys.drain(node_id)
        if draining:
            self.client.put(key, b"{}")
        else:
            self.client.txn([], [Delete(key), Delete(self.keys.slow(node_id))])

    # the whole picture ---------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Jobs, nodes, drains, assignments, statuses, queues and slow marks, read in
        one transaction.

        One revision for all seven, so the scheduler never sees an assignment
        newer than the job record it belongs to.
        """
        k = self.keys
        prefixes = [k.jobs_prefix(), k.nodes_prefix(), k.drains_prefix(),
                    k.assignments_prefix(), k.status_prefix(), k.queues_prefix(),
                    k.slow_prefix()]
        result = self.client.txn([], [Get(p, prefix=True) for p in prefixes])
        jobs_kv, nodes_kv, drains_kv, assign_kv, status_kv, queues_kv, slow_kv = result.gets
        jobs_by_key = self._cache.parse(jobs_kv, JobRecord)
        jobs = {r.job_id: r for r in jobs_by_key.values()}
        job_revisions = {
            jobs_by_key[kv.key].job_id: kv.mod_revision for kv in jobs_kv if kv.key in jobs_by_key
        }
        nodes = {n.node_id: n for n in self._cache.parse(nodes_kv, NodeInfo).values()}
        drains = frozenset(node for kv in drains_kv
                           if (node := k.drained_node(kv.key)) is not None)
        assignments, strays = self._assignments(assign_kv, jobs)
        statuses: dict[str, dict[str, JobNodeStatus]] = {}
        for st in self._cache.parse(status_kv, JobNodeStatus).values():
            statuses.setdefault(st.job_id, {})[st.node_id] = st
        live_keys = {kv.key for group in result.gets for kv in group}
        self._cache.forget_except(live_keys)
        queues = {q.name: q for q in self._cache.parse(queues_kv, QueueSpec).values()}
        slow = {m.node_id: m for key, m in self._cache.parse(slow_kv, SlowMark).items()
                if k.slow_node(key) == m.node_id}
        view = ClusterView(
            jobs=jobs, nodes=nodes, draining=drains, assignments=assignments, statuses=statuses,
            queues=queues, slow=slow,
        )
        return Snapshot(result.revision, view, job_revisions, strays)

    def _assignments(
        self, kvs: Sequence[KeyValue], jobs: dict[str, JobRecord]
    ) -> tuple[dict[str, dict[str, Assignment]], tuple[StrayAssignment, ...]]:
        """Valid assignments of existing jobs (job -> node -> assignment), and the strays."""
        parsed = self._cache.parse(kvs, Assignment)
        assignments: dict[str, dict[str, Assignment]] = {}
        strays: list[StrayAssignment] = []
        for kv in kvs:
            try:
                node_id, job_id = self.keys.parse_assignment(kv.key)
            except ValueError:
                strays.append(StrayAssignment(kv.key, kv.mod_revision, "not an assignment key"))
                continue
            a = parsed.get(kv.key)
            if a is None:
                why = "not a valid assignment"
            elif a.job_id != job_id:
                why = f"names job {a.job_id}, not {job_id}"
            elif job_id not in jobs:
                why = f"job {job_id} does not exist"
            else:
                assignments.setdefault(job_id, {})[node_id] = a
                continue
            strays.append(StrayAssignment(kv.key, kv.mod_revision, why))
        return assignments, tuple(strays)


def _event_put(keys: Keys, job_id: str, event: JobEvent) -> Put:
    return Put(keys.event(job_id, event.seq), event.model_dump_json().encode())


def job_ops(
    keys: Keys,
    record: JobRecord,
    *,
    put: dict[str, Assignment],
    delete: Iterable[str],
    events: Iterable[JobEvent],
    slow: Mapping[str, SlowMark] | None = None,
) -> list[TxnOp]:
    """The operations that write a job's record, assignments and events, and the
    ``slow`` marks of the nodes it evicted as stragglers (with the deletes).

    Cut by :func:`split_ops` when they do not fit one transaction.

    In the order that lets a write cut into several transactions converge
    on the next pass and never hand out a generation twice: the events and
    the record first, then the deletes, then the new assignments.

    * The record counts every generation its assignments hold and every one
      this change hands out (``next_generation``), so no assignment is ever
      written, or deleted, before a stored record counts its generation.
    * A cut after the record leaves assignments that the next pass sees as
      they are: it deletes again what must go (the same rules pick the same
      nodes) and places again what is missing (fresh generations; for a job
      already placed in part, the workers do restart on the new membership).
    * A job that ends has its record written first, so a cut never leaves a
      finished job with no assignments but not finished (the scheduler would
      start it again).
    """
    record_put = Put(keys.job(record.job_id), record.model_dump_json().encode())
    puts: list[TxnOp] = [
        Put(keys.assignment(node, record.job_id), a.model_dump_json().encode())
        for node, a in put.items()
    ]
    deletes: list[TxnOp] = [Delete(keys.assignment(node, record.job_id)) for node in delete]
    deletes += [Put(keys.slow(node), mark.model_dump_json().encode())
                for node, mark in (slow or {}).items()]
    event_puts: list[TxnOp] = [_event_put(keys, record.job_id, e) for e in events]
    return [*event_puts, record_put, *deletes, *puts]


def encode_cursor(job: JobRecord) -> str:
    raw = f"{job.created_at.isoformat()}|{job.job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, str]:
    """Raises ValueError for a cursor this API did not hand out."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError("cursor is not one this API handed out") from exc
    created, sep, job_id = raw.partition("|")
    if not sep:
        raise ValueError("cursor is not one this API handed out")
    return created, job_id
