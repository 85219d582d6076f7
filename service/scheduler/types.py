"""The scheduler's values: what a pass decides on, what it decides, and the small
pure helpers every part of it shares.

* :class:`ClusterView` (the snapshot a pass reads) and :class:`Policy` (its tunables);
* :class:`JobChange` (one job's write), :class:`Reservation` and :class:`Reclaim`
  (why), :class:`Decision` (all of them, from :func:`service.scheduler.decide`);
* the assignment a node gets for a job (:func:`assignment_for`, :func:`with_bounds`);
* the order jobs are served in (:func:`job_order`), when a job began to wait
  (:func:`waiting_since`), what each queue holds (:func:`view_usage`);
* how messages name nodes and quote errors (:func:`names`, :func:`clip`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from rendezvous.records import Assignment, JobNodeStatus
from rendezvous.registry import NodeInfo
from service.api.models import JobEvent, JobRecord, SlowMark
from service.api.queues import QueueSpec, Usage, queue_usage


@dataclass(frozen=True)
class ClusterView:
    """Everything the scheduler decides on. Build it from etcd (or by hand in tests)."""

    jobs: dict[str, JobRecord]
    nodes: dict[str, NodeInfo]
    draining: frozenset[str] = frozenset()
    assignments: dict[str, dict[str, Assignment]] = field(default_factory=dict)  # job -> node ->
    statuses: dict[str, dict[str, JobNodeStatus]] = field(default_factory=dict)  # job -> node ->
    queues: dict[str, QueueSpec] = field(default_factory=dict)  # name -> (default: implicit)
    # node -> its `slow` mark (a straggler's cool-down), expired ones included
    slow: dict[str, SlowMark] = field(default_factory=dict)


#: How long a job that cannot fit waits before its nodes are reserved (see Policy).
RESERVE_AFTER_S = 60.0
#: How long a node evicted as a straggler gets no new placements (see Policy).
STRAGGLER_COOLDOWN_S = 600.0


@dataclass(frozen=True)
class Policy:
    """The scheduler's tunables (the defaults are the coordinator's).

    ``reserve_after_s``: a waiting job that has not fitted for this long gets a
    reservation (:class:`Reservation`); ``math.inf`` turns reservations off.
    ``straggler_cooldown_s``: a node evicted from a job as a straggler gets no new
    placements for this long (:mod:`service.scheduler.stragglers`).
    """

    reserve_after_s: float = RESERVE_AFTER_S
    straggler_cooldown_s: float = STRAGGLER_COOLDOWN_S


#: The coordinator's policy, the default of a pass.
DEFAULT_POLICY = Policy()


@dataclass(frozen=True)
class Reservation:
    """Nodes held for a waiting job: no job borrowing beyond its queue's guarantee
    starts or grows on them, so the job starts once the work already there ends."""

    job_id: str
    nodes: frozenset[str]


@dataclass(frozen=True)
class Reclaim:
    """Slots taken back from ``victim`` (shrunk, or ``preempted`` whole) for ``waiter``."""

    victim: str
    waiter: str
    nodes: tuple[str, ...]
    preempted: bool
    cross_queue: bool


@dataclass
class JobChange:
    """What to write for one job, in one transaction."""

    job_id: str
    record: JobRecord  # the record to write (compared against its mod revision)
    put: dict[str, Assignment] = field(default_factory=dict)  # node -> new assignment
    delete: list[str] = field(default_factory=list)  # nodes whose assignment goes
    events: list[JobEvent] = field(default_factory=list)
    # the job whose waiting made this job give slots back (see Reclaim), if any
    reclaimed_for: str | None = None
    # node -> the `slow` mark its eviction from this job as a straggler writes
    slow: dict[str, SlowMark] = field(default_factory=dict)

    @property
    def decisions(self) -> int:
        return len(self.put) + len(self.delete)


@dataclass
class Decision:
    """What :func:`service.scheduler.decide` chose: the changes, and why (for tests
    and the simulator)."""

    changes: list[JobChange]
    reservations: list[Reservation]
    reclaims: list[Reclaim]


def assignment_for(record: JobRecord, generation: int) -> Assignment:
    """The assignment a node gets for ``record``'s job."""
    spec = record.spec
    env = dict(spec.env)
    if spec.resize_policy is not None:
        env.update(spec.resize_policy.env())
    return Assignment(
        job_id=record.job_id,
        generation=generation,
        command=spec.command,
        cwd=record.cwd,
        env=env,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        gpus_per_node=spec.gpus_per_node,
        max_restarts=spec.max_restarts,
        checkpoint_dir=record.checkpoint_path,
        grace_period_s=spec.grace_period_s,
        zygote_preload=spec.zygote_preload,
    )


def with_bounds(assignment: Assignment, min_nodes: int, max_nodes: int) -> Assignment:
    """``assignment`` with new bounds and nothing else changed, its generation included.

    The agent of its node keeps the runner it runs (it compares generations)
    and the runner takes the bounds over (agent.bounds): new bounds alone
    restart nothing.
    """
    return assignment.model_copy(update={"min_nodes": min_nodes, "max_nodes": max_nodes})


#: Nodes a message lists by name; the rest are counted ("and 280 more").
MAX_NAMES_IN_MESSAGE = 16
#: Longest error text an event or condition quotes.
MAX_ERROR_TEXT = 1024


def names(nodes: Iterable[str]) -> str:
    """Node ids for a message, sorted, at most :data:`MAX_NAMES_IN_MESSAGE` of them."""
    ordered = sorted(nodes)
    shown = ", ".join(ordered[:MAX_NAMES_IN_MESSAGE])
    rest = len(ordered) - MAX_NAMES_IN_MESSAGE
    return f"{shown} and {rest} more" if rest > 0 else shown


def clip(text: str) -> str:
    """``text``, cut at :data:`MAX_ERROR_TEXT` characters (an error an event quotes)."""
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + "..."


def job_order(record: JobRecord) -> tuple[int, datetime, str]:
    """The order jobs are served in: priority (highest first), then submission (FIFO)."""
    return (-record.spec.priority, record.created_at, record.job_id)


def view_usage(view: ClusterView) -> dict[str, Usage]:
    """Slots each queue's unfinished jobs hold and wait for
    (:func:`service.api.queues.queue_usage`)."""
    return queue_usage(
        ((r.job_id, r.spec.queue, r.spec.min_nodes, r.spec.nproc_per_node,
          r.phase.is_terminal()) for r in view.jobs.values()),
        view.assignments,
    )


def waiting_since(record: JobRecord) -> datetime:
    """When a job below its minimum began to wait: its submission, or when it lost
    its ``Scheduled`` condition (a preemption, lost nodes)."""
    for cond in record.conditions:
        if cond.type == "Scheduled" and not cond.status:
            return cond.last_transition_time
    return record.created_at
