"""What every route of the coordinator's API shares: the error shape, the token and
body-size middleware, validated path parameters, and confining user paths to a root.

Every error, whoever raises it (a route, FastAPI's body parsing, Starlette's
routing), is JSON ``{"error": "...", "detail": [...]}`` (:func:`install_error_handlers`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rendezvous.errors import EtcdError, EtcdNoSpaceError
from rendezvous.keys import ID_PATTERN, InvalidIdentifierError
from service.api.models import ErrorBody
from service.coordinator.metrics import CoordinatorMetrics
from service.coordinator.store import JobNotFoundError, StateConflictError

log = logging.getLogger("service.coordinator.app")

JobId = Annotated[str, PathParam(pattern=ID_PATTERN, description="A job id.")]
NodeId = Annotated[str, PathParam(pattern=ID_PATTERN, description="A node id.")]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 404, 409, 413, 422, 503)
}
API_PREFIX = "/v1/"


async def send_error(send: Send, status: int, message: str,
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
        await send_error(send, 413, f"request body is larger than {self.limit} bytes")


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
                await send_error(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


UNAUTHORIZED = "missing or wrong bearer token"


def error_response(status: int, message: str, detail: list[dict[str, Any]] | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    content: dict[str, Any] = {"error": message}
    if detail is not None:
        content["detail"] = detail
    return JSONResponse(content, status_code=status, headers=headers)


def safe_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
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


class HttpError(Exception):
    """A route's refusal, answered as ``{"detail": message}`` with ``status``.

    The coordinator's side; the client's twin is :class:`service.client.errors.ApiError`.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def confine(root: Path, relative: str | None, *, field: str) -> str | None:
    """``root/relative`` as an absolute path, refusing anything that resolves outside root.

    Symlinks are resolved for the parts that exist, so a link pointing out of
    the root is caught too.

    Raises:
        HttpError: 422 naming ``field``.
    """
    if relative is None:
        return None
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / relative))
    if target != base and base not in target.parents:
        raise HttpError(422, f"{field} ({relative!r}) resolves outside the allowed root")
    return str(target)




def install_error_handlers(app: FastAPI, metrics: CoordinatorMetrics) -> None:
    """Every error as ``{"error": ..., "detail": [...]}``, with the status the module
    docstring of :mod:`service.coordinator.app` lists; request counts and latency to ``metrics``."""

    @app.exception_handler(HttpError)
    async def _apierror_response(_: Request, exc: HttpError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = safe_errors(exc.errors())
        fields = ", ".join(f"{d['field']}: {d['msg']}" for d in detail[:5])
        return error_response(422, f"invalid request: {fields}", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Raised by routing (404, 405) and by FastAPI's body parsing: a 400 for a
        # body it could not decode (invalid UTF-8, nesting too deep for json).
        if exc.status_code == 400:
            return error_response(422, "invalid request: body: not valid JSON",
                          [{"loc": ["body"], "field": "body", "msg": "not valid JSON",
                            "type": "json_invalid"}])
        return error_response(exc.status_code, str(exc.detail),
                      headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return error_response(500, "internal error; the coordinator's log has the details")

    @app.exception_handler(JobNotFoundError)
    async def _not_found(_: Request, exc: JobNotFoundError) -> JSONResponse:
        return error_response(404, str(exc))

    @app.exception_handler(StateConflictError)
    async def _conflict(_: Request, exc: StateConflictError) -> JSONResponse:
        return error_response(409, str(exc))

    @app.exception_handler(InvalidIdentifierError)
    async def _bad_id(_: Request, exc: InvalidIdentifierError) -> JSONResponse:
        return error_response(422, str(exc))

    @app.exception_handler(EtcdError)
    async def _etcd(_: Request, exc: EtcdError) -> JSONResponse:
        metrics.etcd_errors.labels(op="api").inc()
        if isinstance(exc, EtcdNoSpaceError):
            return error_response(503, f"etcd is out of space: {exc}")
        return error_response(503, f"etcd is unavailable: {exc}", headers={"Retry-After": "1"})

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
