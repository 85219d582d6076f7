"""Queues: a team's guaranteed share of the cluster, its limit and its weight.

A queue has a ``guaranteed`` number of slots (worker slots: GPUs on GPU
nodes), an optional ``limit`` and a ``weight`` for sharing idle slots. Every
job belongs to one (``default`` unless named). The scheduler
(:mod:`service.scheduler`) gives each queue its guarantee the moment one of its
jobs waits, lends idle slots beyond the guarantees by weight, and takes
borrowed slots back when an owner needs them.

This module holds what etcd stores at ``queues/<name>`` (:class:`QueueSpec`,
written by the coordinator on the admin's request), what the API answers
(:class:`QueueView`), and the pure accounting both the scheduler and the API
use (:func:`queue_usage`). The ``default`` queue always exists: unless an admin
stored one, it guarantees nothing, has no limit and weight 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from rendezvous.records import Assignment, utcnow

#: A queue's name: the same characters as a job id (it becomes part of a key).
QUEUE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
QueueName = Annotated[str, StringConstraints(pattern=QUEUE_PATTERN)]
DEFAULT_QUEUE = "default"
MAX_SLOTS = 1 << 30
MAX_WEIGHT = 1000.0


def check_limit(guaranteed: int, limit: int | None) -> None:
    """Raises ValueError when the limit is below the guarantee, naming both."""
    if limit is not None and limit < guaranteed:
        raise ValueError(f"limit ({limit}) is less than guaranteed ({guaranteed})")


class QueueCreate(BaseModel):
    """``POST /v1/queues``. Strict, like :class:`service.api.models.JobSpec`: ``"2"`` is not
    a number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: QueueName
    guaranteed: int = Field(
        default=0, ge=0, le=MAX_SLOTS,
        description="Slots the queue gets whenever its jobs want them, taking borrowed "
        "slots back from other queues if need be.",
    )
    limit: int | None = Field(
        default=None, ge=1, le=MAX_SLOTS,
        description="Most slots the queue's jobs hold at once (guaranteed plus borrowed); "
        "none: no limit.",
    )
    weight: float = Field(
        default=1.0, gt=0, le=MAX_WEIGHT,
        description="Share of the idle slots beyond the guarantees, relative to the other "
        "queues' weights.",
    )

    @model_validator(mode="after")
    def _limit(self) -> Self:
        check_limit(self.guaranteed, self.limit)
        return self


class QueueSpec(QueueCreate):
    """A queue as ``queues/<name>`` holds it (written by the coordinator only)."""

    created_at: datetime = Field(default_factory=utcnow)


class QueuePatch(BaseModel):
    """``PATCH /v1/queues/{name}``: what to change; ``limit: null`` removes the limit."""

    model_config = ConfigDict(extra="forbid", strict=True)

    guaranteed: int | None = Field(default=None, ge=0, le=MAX_SLOTS)
    limit: int | None = Field(default=None, ge=1, le=MAX_SLOTS)
    weight: float | None = Field(default=None, gt=0, le=MAX_WEIGHT)

    @model_validator(mode="after")
    def _only_limit_is_nullable(self) -> Self:
        """A field left out is unchanged; ``null`` means "no limit", which only ``limit`` has."""
        for name in sorted(self.model_fields_set - {"limit"}):
            if getattr(self, name) is None:
                raise ValueError(f"{name} cannot be null (leave it out to keep it; only "
                                 "limit: null, which removes the limit)")
        return self


def default_queue() -> QueueSpec:
    """The ``default`` queue when no admin stored one."""
    return QueueSpec(name=DEFAULT_QUEUE, created_at=datetime(1970, 1, 1, tzinfo=timezone.utc))


def with_default(queues: Mapping[str, QueueSpec]) -> dict[str, QueueSpec]:
    """``queues`` with the ``default`` queue in it."""
    out = dict(queues)
    out.setdefault(DEFAULT_QUEUE, default_queue())
    return out


class QueueView(BaseModel):
    """A queue as the API shows it: its settings and what its jobs hold now (slots)."""

    name: str
    guaranteed: int
    limit: int | None
    weight: float
    in_use: int = Field(description="Slots its jobs hold.")
    borrowed: int = Field(description="Slots held beyond the guarantee.")
    waiting: int = Field(description="Slots its waiting jobs need to start (their minimum).")
    jobs_running: int
    jobs_waiting: int
    created_at: datetime


class QueueList(BaseModel):
    """``GET /v1/queues``."""

    queues: list[QueueView]
    capacity: int = Field(description="Slots of the live nodes that are not draining.")
    guaranteed_total: int
    warning: str | None = Field(
        default=None, description="Set when the guarantees add up to more than the capacity."
    )


class QueueChanged(BaseModel):
    """What ``POST`` and ``PATCH /v1/queues`` answer: the queue and any warning."""

    queue: QueueView
    warning: str | None = None


def overcommit_warning(guaranteed_total: int, capacity: int) -> str | None:
    """A sentence when the guarantees add up to more than the cluster holds, else None."""
    if guaranteed_total <= capacity:
        return None
    return (f"the queues' guarantees add up to {guaranteed_total} slots but the cluster has "
            f"{capacity}: not every guarantee can be met at once")


@dataclass
class Usage:
    """What one queue's jobs hold and want, in slots."""

    in_use: int = 0
    waiting: int = 0
    jobs_running: int = 0
    jobs_waiting: int = 0
    jobs: list[str] = field(default_factory=list)


def queue_usage(
    jobs: Iterable[tuple[str, str, int, int, bool]],
    assignments: Mapping[str, Mapping[str, Assignment]],
) -> dict[str, Usage]:
    """Slots each queue's unfinished jobs hold and wait for.

    Args:
        jobs: ``(job_id, queue, min_nodes, nproc_per_node, finished)`` per job.
        assignments: job -> node -> assignment (what the jobs hold).

    Returns:
        queue -> :class:`Usage`; a job holding fewer nodes than its minimum
        counts as waiting for its minimum.
    """
    out: dict[str, Usage] = {}
    for job_id, queue, min_nodes, nproc, finished in jobs:
        if finished:
            continue
        usage = out.setdefault(queue, Usage())
        held = assignments.get(job_id, {})
        usage.in_use += sum(a.nproc_per_node for a in held.values())
        usage.jobs.append(job_id)
        if len(held) < min_nodes:
            usage.jobs_waiting += 1
            usage.waiting += (min_nodes - len(held)) * nproc
        else:
            usage.jobs_running += 1
    return out


def queue_view(spec: QueueSpec, usage: Usage | None) -> QueueView:
    usage = usage or Usage()
    return QueueView(
        name=spec.name, guaranteed=spec.guaranteed, limit=spec.limit, weight=spec.weight,
        in_use=usage.in_use, borrowed=max(0, usage.in_use - spec.guaranteed),
        waiting=usage.waiting, jobs_running=usage.jobs_running,
        jobs_waiting=usage.jobs_waiting, created_at=spec.created_at,
    )
