"""The API's jobs and nodes: ``/v1/jobs`` (submit, list, get, scale, cancel, events) and
``/v1/nodes`` (list, drain, undrain).

The rules of a change live in plain functions (:func:`new_record`, :func:`rescale`,
:func:`request_cancel`), which the routes apply inside the store's compare-and-swap
update; they raise :class:`StateConflictError` (409) or :class:`HttpError` and are unit
tested without a server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request

from service.api.models import (
    EventList,
    EventReason,
    JobEvent,
    JobList,
    JobPhase,
    JobRecord,
    JobSpec,
    JobView,
    NodeView,
    ScaleRequest,
    check_bounds,
    check_storable,
    new_job_id,
)
from service.coordinator.routes.access import principal_of
from service.coordinator.routes.common import HttpError, JobId, NodeId, confine
from service.coordinator.routes.queues import QueueStore
from service.coordinator.store import JobStore, StateConflictError, decode_cursor, encode_cursor
from service.coordinator.views import job_view, node_views

# the rules ------------------------------------------------------------------------------


def new_record(spec: JobSpec, *, workdir_root: Path, checkpoint_root: Path
               ) -> tuple[JobRecord, JobEvent]:
    """A submitted job's record and its first event.

    Raises:
        HttpError: 422, the spec cannot be stored in etcd, or a directory
            resolves outside its root.
    """
    try:
        check_storable(spec)
    except ValueError as exc:
        raise HttpError(422, f"invalid request: {exc}") from exc
    record = JobRecord(
        job_id=new_job_id(spec.name),
        spec=spec,
        cwd=confine(workdir_root, spec.working_dir, field="working_dir"),
        checkpoint_path=confine(checkpoint_root, spec.checkpoint_dir, field="checkpoint_dir"),
    )
    event = JobEvent(seq=0, phase=JobPhase.PENDING, reason=EventReason.SUBMITTED,
                     message=f"submitted: {spec.min_nodes}..{spec.max_nodes} node(s)")
    record.next_event = 1
    return record, event


def rescale(record: JobRecord, change: ScaleRequest) -> list[JobEvent]:
    """Apply new bounds to ``record``; the event to write (none if nothing changed).

    Raises:
        StateConflictError: the job has ended or is being cancelled.
        HttpError: 422, the new bounds are invalid (min over max, out of range).
    """
    job_id = record.job_id
    if record.phase.is_terminal():
        raise StateConflictError(f"job {job_id} is {record.phase.value}; it cannot be scaled")
    if record.cancel_requested:
        raise StateConflictError(f"job {job_id} is being cancelled; it cannot be scaled")
    spec = record.spec
    new_min = change.min_nodes if change.min_nodes is not None else spec.min_nodes
    new_max = change.max_nodes if change.max_nodes is not None else spec.max_nodes
    try:
        check_bounds(new_min, new_max)
    except ValueError as exc:
        raise HttpError(422, str(exc)) from exc
    if (new_min, new_max) == (spec.min_nodes, spec.max_nodes):
        return []
    record.spec = spec.model_copy(update={"min_nodes": new_min, "max_nodes": new_max})
    event = JobEvent(seq=record.next_event, phase=record.phase,
                     reason=EventReason.SCALED_BY_USER,
                     message=f"bounds set to {new_min}..{new_max} node(s)")
    record.next_event += 1
    return [event]


def request_cancel(record: JobRecord) -> list[JobEvent]:
    """Mark ``record`` for cancelling (the scheduler stops its nodes).

    Raises:
        StateConflictError: the job has already ended.
    """
    if record.phase.is_terminal():
        raise StateConflictError(f"job {record.job_id} is already {record.phase.value}")
    record.cancel_requested = True
    return []


# the routes -----------------------------------------------------------------------------


def jobs_router(
    *, store: JobStore, queues: QueueStore, workdir_root: Path, checkpoint_root: Path,
    on_change: Callable[[], None],
) -> APIRouter:
    """``/v1/jobs``; the caller adds the token dependency."""
    router = APIRouter(tags=["jobs"])

    def load_view(job_id: str) -> JobView:
        record, _ = store.get(job_id)
        return job_view(record, store.statuses(job_id))

    @router.post("/v1/jobs", status_code=201)
    def submit(spec: JobSpec, request: Request) -> JobView:
        """Submit a job; it starts once its minimum number of nodes is free."""
        principal_of(request).check_queue(spec.queue)
        if not queues.exists(spec.queue):
            raise HttpError(422, f"invalid request: queue: queue {spec.queue} does not exist")
        record, event = new_record(spec, workdir_root=workdir_root,
                                   checkpoint_root=checkpoint_root)
        store.create(record, event)
        on_change()
        return job_view(record, {})

    @router.get("/v1/jobs")
    def list_jobs(
        request: Request,
        phase: Annotated[JobPhase | None, Query(description="Only jobs in this phase.")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(max_length=512)] = None,
    ) -> JobList:
        """Jobs, oldest first, a page at a time."""
        after: tuple[str, str] | None = None
        if cursor is not None:
            try:
                after = decode_cursor(cursor)
            except ValueError as exc:
                raise HttpError(422, f"cursor: {exc}") from exc
        records = sorted(store.list_jobs(), key=lambda r: (r.created_at.isoformat(), r.job_id))
        principal = principal_of(request)  # a queue token sees its queues' jobs only
        records = [r for r in records if principal.may_use(r.spec.queue)]
        if phase is not None:
            records = [r for r in records if r.phase == phase]
        if after is not None:
            records = [r for r in records if (r.created_at.isoformat(), r.job_id) > after]
        page = records[:limit]
        statuses = store.all_statuses() if any(r.nodes for r in page) else {}
        views = [job_view(r, statuses.get(r.job_id, {})) for r in page]
        next_cursor = encode_cursor(page[-1]) if len(records) > limit else None
        return JobList(jobs=views, next_cursor=next_cursor)

    @router.get("/v1/jobs/{job_id}")
    def get_job(job_id: JobId) -> JobView:
        """One job: phase, conditions, world size, nodes, restarts, progress, error."""
        return load_view(job_id)

    @router.patch("/v1/jobs/{job_id}")
    def scale_job(job_id: JobId, change: ScaleRequest) -> JobView:
        """Change a job's minimum and/or maximum number of nodes."""
        store.update(job_id, lambda record: rescale(record, change))
        on_change()
        return load_view(job_id)

    @router.post("/v1/jobs/{job_id}/cancel", status_code=202)
    def cancel_job(job_id: JobId) -> JobView:
        """Cancel a job: its workers get SIGTERM (and checkpoint), then SIGKILL."""
        store.update(job_id, request_cancel)
        on_change()
        return load_view(job_id)

    @router.get("/v1/jobs/{job_id}/events")
    def job_events(job_id: JobId) -> EventList:
        """The job's history: every phase change and resize, with its reason."""
        store.get(job_id)  # 404 for an unknown job
        return EventList(events=store.events(job_id))

    return router


def nodes_router(*, store: JobStore, on_change: Callable[[], None]) -> APIRouter:
    """``/v1/nodes``; the caller adds the token dependency."""
    router = APIRouter(tags=["nodes"])

    def one_node(node_id: str) -> NodeView:
        for node in node_views(store.snapshot()):
            if node.node_id == node_id:
                return node
        raise HttpError(404, f"node {node_id} is not registered")

    def set_drain(node_id: str, on: bool) -> NodeView:
        if store.nodes().get(node_id) is None:
            raise HttpError(404, f"node {node_id} is not registered")
        store.set_drain(node_id, on)
        on_change()
        return one_node(node_id)

    @router.get("/v1/nodes")
    def list_nodes() -> list[NodeView]:
        """Live nodes: state, slots, labels, the jobs on each, and the ``slow`` condition."""
        return node_views(store.snapshot())

    @router.post("/v1/nodes/{node_id}/drain")
    def drain_node(node_id: NodeId) -> NodeView:
        """Take a node out of service: its jobs checkpoint and go on without it."""
        return set_drain(node_id, True)

    @router.delete("/v1/nodes/{node_id}/drain")
    def undrain_node(node_id: NodeId) -> NodeView:
        """Put a drained node back in service; clears its ``slow`` condition too."""
        return set_drain(node_id, False)

    return router


__all__ = ["jobs_router", "new_record", "nodes_router", "request_cancel", "rescale"]
