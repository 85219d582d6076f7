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

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rendezvous.election import Election
from rendezvous.errors import EtcdError, EtcdNoSpaceError
from rendezvous.keys import InvalidIdentifierError
from rendezvous.records import JobNodeState, JobNodeStatus
from service.logs import logs_router
from service.metrics import CoordinatorMetrics
from service.models import (
    ErrorBody,
    EventList,
    EventReason,
    JobEvent,
    JobList,
    JobPhase,
    JobRecord,
    JobSpec,
    JobView,
    NodeInJob,
    NodeView,
    ScaleRequest,
    SpecView,
    check_bounds,
    check_storable,
    new_job_id,
)
from service.queues_access import QueueScope, Tokens, principal_of
from service.queues_api import QueueStore, queue_router
from service.scheduler import CHARGED_REASON, restart_charges, statuses_in_force
from service.store import ConflictError, JobNotFoundError, JobStore, decode_cursor, encode_cursor
from service.ui import ui_router

log = logging.getLogger(__name__)

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
JobId = Annotated[str, PathParam(pattern=ID_PATTERN, description="A job id.")]
NodeId = Annotated[str, PathParam(pattern=ID_PATTERN, description="A node id.")]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 404, 409, 413, 422, 503)
}
API_PREFIX = "/v1/"


async def _send_error(send: Send, status: int, message: str,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer with the API's error shape from ASGI middleware (before any route runs)."""
    body = JSONResponse({"error": message}, status_code=status).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413.

    Checks Content-Length up front; a body without one (chunked) is read here,
    at most ``limit`` bytes of it, before the app sees any: a 10 MB body is
    refused without being held in memory, and with 413 (an error raised while
    FastAPI reads the body would become its 400).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        await _send_error(send, 413, f"request body is larger than {self.limit} bytes")


class TokenCheck:
    """ASGI middleware: /v1 requests without the bearer token get 401 before anything else.

    Before the body is read or parsed, so a malformed or oversized body from
    someone without the token learns nothing. The routes' ``Depends``
    documents the scheme in the OpenAPI document and checks again.
    """

    def __init__(self, app: ASGIApp, check: Callable[[str | None], bool]) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(API_PREFIX):
            given = None
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    given = value.decode("latin-1")
            if not self.check(given):
                await _send_error(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


UNAUTHORIZED = "missing or wrong bearer token"


def _error(status: int, message: str, detail: list[dict[str, Any]] | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    content: dict[str, Any] = {"error": message}
    if detail is not None:
        content["detail"] = detail
    return JSONResponse(content, status_code=status, headers=headers)


def _safe_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Validation errors without the offending values (they may be secrets)."""
    out = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ())]
        kind = str(err.get("type", ""))
        if kind == "json_invalid":  # its loc is a character offset, not a field
            loc, msg = ["body"], "not valid JSON"
        else:
            msg = str(err.get("msg", "invalid"))
        out.append({"loc": loc, "field": ".".join(loc[1:]) or ".".join(loc),
                    "msg": msg, "type": kind})
    return out


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def confine(root: Path, relative: str | None, *, field: str) -> str | None:
    """``root/relative`` as an absolute path, refusing anything that resolves outside root.

    Symlinks are resolved for the parts that exist, so a link pointing out of
    the root is caught too.

    Raises:
        ApiError: 422 naming ``field``.
    """
    if relative is None:
        return None
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / relative))
    if target != base and base not in target.parents:
        raise ApiError(422, f"{field} ({relative!r}) resolves outside the allowed root")
    return str(target)


def progress_fields(current: dict[str, JobNodeStatus], statuses: dict[str, JobNodeStatus]
                    ) -> dict[str, Any]:
    """JobView's progress from the nodes' reports: the largest rate (each is the job's
    global rate as one rank measures it), the mean loss and the total over the nodes
    in force, the newest checkpoint's time over every node."""
    now = list(current.values())
    rates = [st.samples_per_second for st in now if st.samples_per_second is not None]
    losses = [st.loss for st in now if st.loss is not None]
    totals = [st.total_steps for st in now if st.total_steps is not None]
    saved = [st.last_checkpoint_time for st in statuses.values()
             if st.last_checkpoint_time is not None]
    return {
        "samples_per_second": max(rates, default=None),
        "loss": sum(losses) / len(losses) if losses else None,
        "total_steps": max(totals, default=None),
        "last_checkpoint_at": (datetime.fromtimestamp(max(saved), timezone.utc)
                               if saved else None),
    }


def goodput_fields(statuses: dict[str, JobNodeStatus]) -> dict[str, Any]:
    """JobView's goodput: productive node-seconds over productive + lost, and the lost
    node-seconds by cause, over the nodes' reports (docs/checkpoints.md)."""
    productive = sum(st.productive_seconds or 0.0 for st in statuses.values())
    lost: dict[str, float] = {}
    for st in statuses.values():
        for cause, seconds in st.lost_seconds.items():
            lost[cause] = lost.get(cause, 0.0) + seconds
    spent = productive + sum(lost.values())
    return {"goodput": productive / spent if spent > 0 else None, "lost_seconds": lost}


def job_view(record: JobRecord, statuses: dict[str, JobNodeStatus]) -> JobView:
    """A job as the API shows it: the record joined with its nodes' reports."""
    current = statuses_in_force(record.nodes, statuses)  # record.nodes mirrors assignments
    running = [st.world_size for st in current.values() if st.state == JobNodeState.RUNNING]
    steps = [st.last_step for st in (current or statuses).values() if st.last_step is not None]
    ckpts = [st.last_checkpoint_step for st in statuses.values()
             if st.last_checkpoint_step is not None]
    restarts = dict(record.restarts)
    # What the agents charged since the scheduler last counted it into the record.
    _, rises = restart_charges(record.charged, record.nodes, current)
    for charge in rises:
        restarts[CHARGED_REASON] = restarts.get(CHARGED_REASON, 0) + charge.count - charge.before
    nodes = [
        NodeInJob(
            node_id=node,
            state=current[node].state.value if node in current else "assigned",
            ranks=current[node].ranks if node in current else [],
            devices=current[node].devices if node in current else [],
            last_step=current[node].last_step if node in current else None,
            restart_count=current[node].restart_count if node in current else 0,
        )
        for node in sorted(record.nodes)
    ]
    return JobView(
        job_id=record.job_id,
        spec=SpecView.of(record.spec),
        phase=record.phase,
        cancel_requested=record.cancel_requested,
        conditions=record.conditions,
        world_size=max(running, default=0) if not record.phase.is_terminal() else 0,
        nodes=nodes,
        restarts=restarts,
        restart_count=sum(restarts.values()),
        last_step=max(steps, default=None),
        last_checkpoint_step=max(ckpts, default=None),
        **progress_fields(current, statuses),
        **goodput_fields(statuses),
        exit_reason=record.exit_reason,
        error=record.error,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
    )


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
        queue_tokens: token -> the queues it is scoped to (service.queues_access).
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
            raise ApiError(401, UNAUTHORIZED)

    Auth = Depends(authenticate)

    # errors ----------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.message, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = _safe_errors(exc.errors())
        fields = ", ".join(f"{d['field']}: {d['msg']}" for d in detail[:5])
        return _error(422, f"invalid request: {fields}", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Raised by routing (404, 405) and by FastAPI's body parsing: a 400 for a
        # body it could not decode (invalid UTF-8, nesting too deep for json).
        if exc.status_code == 400:
            return _error(422, "invalid request: body: not valid JSON",
                          [{"loc": ["body"], "field": "body", "msg": "not valid JSON",
                            "type": "json_invalid"}])
        return _error(exc.status_code, str(exc.detail),
                      headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return _error(500, "internal error; the coordinator's log has the details")

    @app.exception_handler(JobNotFoundError)
    async def _not_found(_: Request, exc: JobNotFoundError) -> JSONResponse:
        return _error(404, str(exc))

    @app.exception_handler(ConflictError)
    async def _conflict(_: Request, exc: ConflictError) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(InvalidIdentifierError)
    async def _bad_id(_: Request, exc: InvalidIdentifierError) -> JSONResponse:
        return _error(422, str(exc))

    @app.exception_handler(EtcdError)
    async def _etcd(_: Request, exc: EtcdError) -> JSONResponse:
        metrics.etcd_errors.labels(op="api").inc()
        if isinstance(exc, EtcdNoSpaceError):
            return _error(503, f"etcd is out of space: {exc}")
        return _error(503, f"etcd is unavailable: {exc}", headers={"Retry-After": "1"})

    @app.middleware("http")
    async def _measure(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        template = getattr(route, "path", "unmatched")
        metrics.requests.labels(template, request.method, str(response.status_code)).inc()
        metrics.request_duration.labels(template, request.method).observe(
            time.perf_counter() - started
        )
        return response

    # jobs ------------------------------------------------------------------------------

    def load_view(job_id: str) -> JobView:
        record, _ = store.get(job_id)
        return job_view(record, store.statuses(job_id))

    @app.post("/v1/jobs", status_code=201, dependencies=[Auth], tags=["jobs"])
    def submit(spec: JobSpec, request: Request) -> JobView:
        """Submit a job; it starts once its minimum number of nodes is free."""
        principal_of(request).check_queue(spec.queue)
        if not queues.exists(spec.queue):
            raise ApiError(422, f"invalid request: queue: queue {spec.queue} does not exist")
        try:
            check_storable(spec)
        except ValueError as exc:
            raise ApiError(422, f"invalid request: {exc}") from exc
        record = JobRecord(
            job_id=new_job_id(spec.name),
            spec=spec,
            cwd=confine(workdir_root, spec.working_dir, field="working_dir"),
            checkpoint_path=confine(checkpoint_root, spec.checkpoint_dir, field="checkpoint_dir"),
        )
        event = JobEvent(seq=0, phase=JobPhase.PENDING, reason=EventReason.SUBMITTED,
                         message=f"submitted: {spec.min_nodes}..{spec.max_nodes} node(s)")
        record.next_event = 1
        store.create(record, event)
        on_change()
        return job_view(record, {})

    @app.get("/v1/jobs", dependencies=[Auth], tags=["jobs"])
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
                raise ApiError(422, f"cursor: {exc}") from exc
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

    @app.get("/v1/jobs/{job_id}", dependencies=[Auth], tags=["jobs"])
    def get_job(job_id: JobId) -> JobView:
        """One job: phase, conditions, world size, nodes, restarts, progress, error."""
        return load_view(job_id)

    @app.patch("/v1/jobs/{job_id}", dependencies=[Auth], tags=["jobs"])
    def scale_job(job_id: JobId, change: ScaleRequest) -> JobView:
        """Change a job's minimum and/or maximum number of nodes."""

        def mutate(record: JobRecord) -> list[JobEvent]:
            if record.phase.is_terminal():
                raise ConflictError(f"job {job_id} is {record.phase.value}; it cannot be scaled")
            if record.cancel_requested:
                raise ConflictError(f"job {job_id} is being cancelled; it cannot be scaled")
            spec = record.spec
            new_min = change.min_nodes if change.min_nodes is not None else spec.min_nodes
            new_max = change.max_nodes if change.max_nodes is not None else spec.max_nodes
            try:
                check_bounds(new_min, new_max)
            except ValueError as exc:
                raise ApiError(422, str(exc)) from exc
            if (new_min, new_max) == (spec.min_nodes, spec.max_nodes):
                return []
            record.spec = spec.model_copy(update={"min_nodes": new_min, "max_nodes": new_max})
            event = JobEvent(seq=record.next_event, phase=record.phase,
                             reason=EventReason.SCALED_BY_USER,
                             message=f"bounds set to {new_min}..{new_max} node(s)")
            record.next_event += 1
            return [event]

        store.update(job_id, mutate)
        on_change()
        return load_view(job_id)

    @app.post("/v1/jobs/{job_id}/cancel", status_code=202, dependencies=[Auth], tags=["jobs"])
    def cancel_job(job_id: JobId) -> JobView:
        """Cancel a job: its workers get SIGTERM (and checkpoint), then SIGKILL."""

        def mutate(record: JobRecord) -> list[JobEvent]:
            if record.phase.is_terminal():
                raise ConflictError(f"job {job_id} is already {record.phase.value}")
            record.cancel_requested = True
            return []

        store.update(job_id, mutate)
        on_change()
        return load_view(job_id)

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Auth], tags=["jobs"])
    def job_events(job_id: JobId) -> EventList:
        """The job's history: every phase change and resize, with its reason."""
        store.get(job_id)  # 404 for an unknown job
        return EventList(events=store.events(job_id))

    # nodes -----------------------------------------------------------------------------

    def node_views() -> list[NodeView]:
        snap = store.snapshot()
        view = snap.view
        placed: dict[str, list[str]] = {}
        used: dict[str, int] = {}
        gpus_used: dict[str, int] = {}
        for job_id, per_node in view.assignments.items():
            for node_id, a in per_node.items():
                placed.setdefault(node_id, []).append(job_id)
                used[node_id] = used.get(node_id, 0) + a.nproc_per_node
                gpus_used[node_id] = gpus_used.get(node_id, 0) + a.gpus_per_node
        return [
            NodeView(
                node_id=n.node_id, host=n.host, address=n.address,
                state="draining" if n.node_id in view.draining else "live",
                slots=n.slots, slots_used=used.get(n.node_id, 0), gpus=n.gpus,
                gpus_used=gpus_used.get(n.node_id, 0), gpu_devices=n.gpu_devices,
                labels=n.labels, jobs=sorted(placed.get(n.node_id, [])),
            )
            for n in sorted(view.nodes.values(), key=lambda n: n.node_id)
        ]

    def one_node(node_id: str) -> NodeView:
        for node in node_views():
            if node.node_id == node_id:
                return node
        raise ApiError(404, f"node {node_id} is not registered")

    @app.get("/v1/nodes", dependencies=[Auth], tags=["nodes"])
    def list_nodes() -> list[NodeView]:
        """Live nodes: state, slots, labels and the jobs on each."""
        return node_views()

    @app.post("/v1/nodes/{node_id}/drain", dependencies=[Auth], tags=["nodes"])
    def drain_node(node_id: NodeId) -> NodeView:
        """Take a node out of service: its jobs checkpoint and go on without it."""
        if store.nodes().get(node_id) is None:
            raise ApiError(404, f"node {node_id} is not registered")
        store.set_drain(node_id, True)
        on_change()
        return one_node(node_id)

    @app.delete("/v1/nodes/{node_id}/drain", dependencies=[Auth], tags=["nodes"])
    def undrain_node(node_id: NodeId) -> NodeView:
        """Put a drained node back in service."""
        if store.nodes().get(node_id) is None:
            raise ApiError(404, f"node {node_id} is not registered")
        store.set_drain(node_id, False)
        on_change()
        return one_node(node_id)

    app.include_router(ui_router(auth=Auth, grafana_url=grafana_url))  # the web page, /ui/

    app.include_router(logs_router(store=store, auth=Auth))  # a job's logs, from its agents

    app.include_router(queue_router(store=store, on_change=on_change), dependencies=[Auth])

    # health and metrics ----------------------------------------------------------------

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"model": ErrorBody}})
    def readyz() -> JSONResponse:
        """etcd answers, a leader is elected, and this replica's reconcile passes succeed."""
        try:
            store.client.status()
            leader = election.leader() if election is not None else None
        except EtcdError as exc:
            return _error(503, f"etcd is unavailable: {exc}")
        if election is not None and leader is None:
            return _error(503, "no coordinator leads yet")
        problem = reconcile_problem()
        if problem is not None:
            return _error(503, problem)
        return JSONResponse({"status": "ready",
                             "leader": leader.value.decode() if leader is not None else None})

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def metrics_route() -> Response:
        """Prometheus metrics (an explicit route: a mounted app would redirect)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

