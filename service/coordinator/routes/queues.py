"""The queues' HTTP API and their storage in etcd (``queues/<name>``).

``GET /v1/queues`` and ``GET /v1/queues/{name}`` show each queue's settings
and what its jobs hold (guaranteed, in use, borrowed, waiting); ``POST``,
``PATCH`` and ``DELETE`` change them and need the admin token
(:mod:`service.coordinator.routes.access`). A queue's record is written by the
coordinator only, with compare-and-set on its mod revision, like a job's. A
queue that unfinished jobs still use cannot be deleted (409). When the
guarantees add up to more than the cluster's slots, the answer says so
(``warning``): they cannot all be met at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from rendezvous.etcd import Compare, Delete, Put
from service.api.queues import (
    DEFAULT_QUEUE,
    QUEUE_PATTERN,
    QueueChanged,
    QueueCreate,
    QueueList,
    QueuePatch,
    QueueSpec,
    QueueView,
    Usage,
    check_limit,
    overcommit_warning,
    queue_view,
    with_default,
)
from service.coordinator.routes.access import principal_of, require_admin
from service.coordinator.store import (
    MAX_CAS_ATTEMPTS,
    JobNotFoundError,
    JobStore,
    StateConflictError,
)
from service.scheduler import ClusterView, view_usage

QueueNameParam = Annotated[str, PathParam(pattern=QUEUE_PATTERN, description="A queue's name.")]


class QueueNotFoundError(JobNotFoundError):
    """No queue has this name (HTTP 404, as for a job)."""


class QueueStore:
    """Queues in etcd, beside the jobs of ``store``."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.client = store.client
        self.keys = store.keys

    def stored(self) -> dict[str, QueueSpec]:
        """The queues an admin created (the implicit ``default`` is not among them)."""
        kvs, _ = self.client.get_prefix(self.keys.queues_prefix())
        return {q.name: q for q in (QueueSpec.model_validate_json(kv.value) for kv in kvs)}

    def get(self, name: str) -> tuple[QueueSpec, int]:
        """The queue and its mod revision (0: the implicit ``default``).

        Raises:
            QueueNotFoundError: no such queue.
        """
        kv = self.client.get(self.keys.queue(name))
        if kv is not None:
            return QueueSpec.model_validate_json(kv.value), kv.mod_revision
        if name == DEFAULT_QUEUE:
            return with_default({})[DEFAULT_QUEUE], 0
        raise QueueNotFoundError(f"queue {name} does not exist")

    def exists(self, name: str) -> bool:
        return name == DEFAULT_QUEUE or self.client.get(self.keys.queue(name)) is not None

    def create(self, spec: QueueSpec) -> None:
        """Raises StateConflictError: a queue of this name exists."""
        key = self.keys.queue(spec.name)
        exists = spec.name == DEFAULT_QUEUE  # the implicit one: PATCH it instead
        if exists or not self.client.txn(
            [Compare(key, "version", "==", 0)], [Put(key, spec.model_dump_json().encode())]
        ).succeeded:
            raise StateConflictError(f"queue {spec.name} exists")

    def update(self, name: str, change: QueuePatch) -> QueueSpec:
        """Apply ``change`` with compare-and-set; ``default`` is stored on its first change.

        Raises:
            QueueNotFoundError: no such queue.
            ValueError: the result is invalid (a limit below the guarantee).
            StateConflictError: the queue kept changing.
        """
        key = self.keys.queue(name)
        for _ in range(MAX_CAS_ATTEMPTS):
            spec, revision = self.get(name)
            fields = change.model_dump(exclude_unset=True)
            new = spec.model_copy(update=fields)
            check_limit(new.guaranteed, new.limit)
            guard = (Compare(key, "mod", "==", revision) if revision
                     else Compare(key, "version", "==", 0))
            if self.client.txn([guard], [Put(key, new.model_dump_json().encode())]).succeeded:
                return new
        raise StateConflictError(f"queue {name} kept changing; try again")

    def delete(self, name: str, revision: int) -> bool:
        key = self.keys.queue(name)
        return self.client.txn([Compare(key, "mod", "==", revision)], [Delete(key)]).succeeded


def _capacity(view: ClusterView) -> int:
    return sum(n.slots for n_id, n in view.nodes.items() if n_id not in view.draining)


def queue_router(*, store: JobStore, on_change: Callable[[], None] = lambda: None) -> APIRouter:
    """The /v1/queues routes (include with the API's authentication dependency).

    Args:
        store: etcd access (the coordinator's credentials).
        on_change: called after a queue changed (wakes the local reconcile loop).
    """
    queues = QueueStore(store)
    router = APIRouter(tags=["queues"])

    def overview() -> tuple[dict[str, QueueSpec], dict[str, Usage], int]:
        snap = store.snapshot()
        all_queues = with_default(queues.stored())
        return all_queues, view_usage(snap.view), _capacity(snap.view)

    def changed(name: str) -> QueueChanged:
        all_queues, usage, capacity = overview()
        total = sum(q.guaranteed for q in all_queues.values())
        return QueueChanged(queue=queue_view(all_queues[name], usage.get(name)),
                            warning=overcommit_warning(total, capacity))

    @router.get("/v1/queues")
    def list_queues(request: Request) -> QueueList:
        """Queues: guaranteed, limit, weight, and the slots their jobs hold and wait for."""
        principal = principal_of(request)
        all_queues, usage, capacity = overview()
        total = sum(q.guaranteed for q in all_queues.values())
        views = [queue_view(q, usage.get(name)) for name, q in sorted(all_queues.items())
                 if principal.may_use(name)]
        return QueueList(queues=views, capacity=capacity, guaranteed_total=total,
                         warning=overcommit_warning(total, capacity))

    @router.post("/v1/queues", status_code=201)
    def create_queue(body: QueueCreate, request: Request) -> QueueChanged:
        """Create a queue (admin token). Says so when the guarantees exceed the cluster."""
        require_admin(request, "create queues")
        queues.create(QueueSpec(**body.model_dump()))
        on_change()
        return changed(body.name)

    @router.get("/v1/queues/{name}")
    def get_queue(name: QueueNameParam, request: Request) -> QueueView:
        """One queue: its settings and what its jobs hold."""
        principal_of(request).check_queue(name)
        spec, _ = queues.get(name)
        _, usage, _ = overview()
        return queue_view(spec, usage.get(name))

    @router.patch("/v1/queues/{name}")
    def patch_queue(name: QueueNameParam, body: QueuePatch, request: Request) -> QueueChanged:
        """Change a queue's guarantee, limit or weight (admin token)."""
        require_admin(request, "change queues")
        try:
            queues.update(name, body)
        except (ValueError, ValidationError) as exc:
            raise HTTPException(422, f"invalid request: {exc}") from exc
        on_change()
        return changed(name)

    @router.delete("/v1/queues/{name}")
    def delete_queue(name: QueueNameParam, request: Request) -> QueueView:
        """Delete a queue that no unfinished job uses (admin token); answers what it was."""
        require_admin(request, "delete queues")
        if name == DEFAULT_QUEUE:
            raise StateConflictError("the default queue cannot be deleted")
        spec, revision = queues.get(name)
        users = sorted(
            r.job_id for r in store.list_jobs()
            if r.spec.queue == name and not r.phase.is_terminal()
        )
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise StateConflictError(f"queue {name} has unfinished jobs: {shown}")
        if not queues.delete(name, revision):
            raise StateConflictError(f"queue {name} changed meanwhile; try again")
        on_change()
        return queue_view(spec, None)

    return router
