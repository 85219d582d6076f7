"""The coordinator's HTTP API (FastAPI): jobs, nodes, metrics, health.

``create_app(...)`` builds the app from its parts; nothing here is a module-level
singleton. Routes that call etcd (a blocking client) are plain ``def``, so
FastAPI runs them in its thread pool and the event loop never blocks.

Every /v1 route needs ``Authorization: Bearer TOKEN`` (compared in constant
time), checked before the body is read or parsed; /healthz, /readyz and
/metrics are open. Every error, whoever raises it (a route, FastAPI's body
parsing, Starlette's routing), is JSON ``{"error": "...", "detail": [...]}``:
401 no or wrong token, 404 unknown job, node or route, 405 a method the route
does not have, 409 a change the job's phase does not allow, 413 a body over
the limit (chunked or not), 422 invalid input naming the field (a body that is
not JSON, not UTF-8 or nested too deeply included; values are never echoed: a
job's environment may hold secrets), 500 a bug, 503 etcd unreachable or out of
space.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rendezvous.election import Election
from rendezvous.errors import EtcdError
from service.api.models import ErrorBody
from service.coordinator.metrics import CoordinatorMetrics
from service.coordinator.routes.access import QueueScope, Tokens
from service.coordinator.routes.common import (
    ERRORS,
    UNAUTHORIZED,
    BodyLimit,
    HttpError,
    TokenCheck,
    error_response,
    install_error_handlers,
)
from service.coordinator.routes.jobs import jobs_router, nodes_router
from service.coordinator.routes.logs import logs_router
from service.coordinator.routes.queues import QueueStore, queue_router
from service.coordinator.store import JobNotFoundError, JobStore
from service.ui import ui_router


def create_app(
    *,
    store: JobStore,
    metrics: CoordinatorMetrics,
    registry: CollectorRegistry,
    token: str | None,
    workdir_root: Path,
    checkpoint_root: Path,
    election: Election | None = None,
    max_body_bytes: int = 1 << 20,
    queue_tokens: Mapping[str, frozenset[str]] | None = None,
    on_change: Callable[[], None] = lambda: None,
    reconcile_problem: Callable[[], str | None] = lambda: None,
    grafana_url: str | None = None,
) -> FastAPI:
    """Build the API.

    Args:
        store: etcd access.
        metrics: the coordinator's metrics (request counts and latency go there).
        registry: what /metrics serves.
        token: the bearer token /v1 requires; None turns authentication off.
        workdir_root / checkpoint_root: where jobs' working and checkpoint
            directories must stay.
        election: this replica's election, for /readyz (a leader must exist).
        max_body_bytes: request bodies over this are refused with 413.
        queue_tokens: token -> the queues it is scoped to (service.coordinator.routes.access).
        on_change: called after a job changed (wakes the local reconcile loop).
        reconcile_problem: why this replica's reconcile passes are failing, or
            None (/readyz answers 503 with it).
        grafana_url: the Grafana that shows tidal's dashboard (the web page links to it).
    """
    app = FastAPI(
        title="tidal coordinator",
        version="1",
        description="Elastic, fault-tolerant training jobs for PyTorch.",
        responses=ERRORS,
    )
    tokens = Tokens(token, queue_tokens or {})
    queues = QueueStore(store)

    def token_ok(authorization: str | None) -> bool:
        return tokens.resolve(authorization) is not None

    def job_queue(job_id: str) -> str | None:
        try:
            return store.get(job_id)[0].spec.queue
        except JobNotFoundError:
            return None

    # The last added runs first: the token, then the body's size, then queue scopes.
    app.add_middleware(QueueScope, tokens=tokens, job_queue=job_queue)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(TokenCheck, check=token_ok)

    def authenticate(authorization: Annotated[str | None, Header()] = None) -> None:
        if not token_ok(authorization):
            raise HttpError(401, UNAUTHORIZED)

    Auth = Depends(authenticate)

    install_error_handlers(app, metrics)

    app.include_router(jobs_router(store=store, queues=queues, workdir_root=workdir_root,
                                   checkpoint_root=checkpoint_root, on_change=on_change),
                       dependencies=[Auth])
    app.include_router(nodes_router(store=store, on_change=on_change), dependencies=[Auth])
    app.include_router(ui_router(auth=Auth, grafana_url=grafana_url))  # the web page, /ui/

    app.include_router(logs_router(store=store, auth=Auth))  # a job's logs, from its agents

    app.include_router(queue_router(store=store, on_change=on_change), dependencies=[Auth])

    app.include_router(health_router(store=store, election=election, registry=registry,
                                     reconcile_problem=reconcile_problem))

    return app


def health_router(*, store: JobStore, election: Election | None, registry: CollectorRegistry,
                  reconcile_problem: Callable[[], str | None]) -> APIRouter:
    """``/healthz``, ``/readyz`` and ``/metrics``: open, no token."""
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @router.get("/readyz", responses={503: {"model": ErrorBody}})
    def readyz() -> JSONResponse:
        """etcd answers, a leader is elected, and this replica's reconcile passes succeed."""
        try:
            store.client.status()
            leader = election.leader() if election is not None else None
        except EtcdError as exc:
            return error_response(503, f"etcd is unavailable: {exc}")
        if election is not None and leader is None:
            return error_response(503, "no coordinator leads yet")
        problem = reconcile_problem()
        if problem is not None:
            return error_response(503, problem)
        return JSONResponse({"status": "ready",
                             "leader": leader.value.decode() if leader is not None else None})

    @router.get("/metrics", response_class=PlainTextResponse)
    def metrics_route() -> Response:
        """Prometheus metrics (an explicit route: a mounted app would redirect)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
