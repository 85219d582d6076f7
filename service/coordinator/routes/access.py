"""Who may do what: the admin token, and tokens scoped to queues.

The coordinator's token (``--token``) is the admin's: it manages queues and
nodes and sees every job. A queue token (``--queue-tokens-file``) is scoped to
some queues: it submits, scales, cancels and reads only the jobs of those
queues, lists only them, and reads those queues; everything else is refused
with 403 naming the queue (or what it tried).

The file holds one token per line: ``QUEUE[,QUEUE...] TOKEN`` (``#`` starts a
comment). Tokens are compared in constant time, like the admin's.

:class:`QueueScope` is ASGI middleware: it resolves the bearer token to a
:class:`Principal` (in ``scope["state"]["principal"]``, where routes find it
with :func:`principal_of`) and refuses a scoped token before any route runs,
unless the route is one that checks scopes itself: the job routes (the job's
queue is looked up here), ``GET`` of jobs, queues and nodes. New /v1 routes are
closed to scoped tokens until they are added here.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from rendezvous.keys import InvalidIdentifierError, validate_id
from service.coordinator.routes.common import UNAUTHORIZED, send_error  # the API's one error shape

MIN_TOKEN_LEN = 16


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: the admin (``queues`` None) or a token scoped to queues."""

    queues: frozenset[str] | None = None

    @property
    def admin(self) -> bool:
        return self.queues is None

    def may_use(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    def check_queue(self, queue: str, what: str = "") -> None:
        """Raises HTTPException 403 naming ``queue`` unless this principal may use it."""
        if not self.may_use(queue):
            raise HTTPException(403, self.refusal(queue, what))

    def refusal(self, queue: str, what: str = "") -> str:
        scope = ", ".join(sorted(self.queues or ()))
        subject = f"{what} is in queue {queue}" if what else f"queue {queue}"
        return (f"{subject}: this token may use only queue(s) {scope}")


ADMIN = Principal()


def principal_of(request: Request) -> Principal:
    """The request's principal (the admin when authentication is off)."""
    principal = request.scope.get("state", {}).get("principal")
    return principal if isinstance(principal, Principal) else ADMIN


def require_admin(request: Request, action: str) -> None:
    """Raises HTTPException 403 unless the request carries the admin token."""
    principal = principal_of(request)
    if not principal.admin:
        raise HTTPException(403, f"only the admin token may {action}; this token may use "
                                 f"only queue(s) {', '.join(sorted(principal.queues or ()))}")


class QueueTokensError(ValueError):
    """The queue tokens file is unreadable or malformed (the message never shows a token)."""


def load_queue_tokens(path: Path) -> dict[str, frozenset[str]]:
    """Token -> queues, from a ``QUEUE[,QUEUE...] TOKEN`` per line file.

    Raises:
        QueueTokensError: naming the line, never the token.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise QueueTokensError(f"cannot read the queue tokens file {path}: {exc}") from exc
    tokens: dict[str, frozenset[str]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise QueueTokensError(f"{path}:{number}: expected 'QUEUE[,QUEUE...] TOKEN'")
        names, token = parts
        try:
            queues = frozenset(validate_id(q, what="queue name") for q in names.split(","))
        except InvalidIdentifierError as exc:
            raise QueueTokensError(f"{path}:{number}: {exc}") from exc
        if len(token) < MIN_TOKEN_LEN:
            raise QueueTokensError(f"{path}:{number}: a token must be at least "
                                   f"{MIN_TOKEN_LEN} characters")
        if token in tokens:
            raise QueueTokensError(f"{path}:{number}: this token is given twice")
        tokens[token] = queues
    return tokens


class Tokens:
    """The admin token and the scoped ones; resolves an Authorization header.

    Args:
        admin: the admin token; None turns authentication off (everyone is admin).
        scoped: token -> the queues it may use.
    """

    def __init__(self, admin: str | None, scoped: Mapping[str, frozenset[str]] = {}) -> None:
        self.admin = admin.encode() if admin is not None else None
        self.scoped = [(t.encode(), Principal(q)) for t, q in scoped.items()]

    def resolve(self, authorization: str | None) -> Principal | None:
        """The principal of a header, or None for a missing or unknown token."""
        if self.admin is None:
            return ADMIN
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        raw = given.strip().encode()
        found: Principal | None = None
        # Every token is compared, so the time taken says nothing about which matched.
        if hmac.compare_digest(raw, self.admin):
            found = ADMIN
        for token, principal in self.scoped:
            if hmac.compare_digest(raw, token):
                found = principal
        return found


_JOB_PATH = re.compile(r"^/v1/jobs/([^/]+)(/[^/]+)?$")
# Routes a scoped token may call: they check its queues themselves.
_OPEN_TO_SCOPED = {
    ("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/queues"), ("GET", "/v1/nodes"),
}
_QUEUE_PATH = re.compile(r"^/v1/queues/([^/]+)$")


class QueueScope:
    """ASGI middleware: put the request's principal in its scope; refuse a scoped
    token on a job of another queue and on the routes that are the admin's.

    Args:
        app: the application.
        tokens: resolves the Authorization header (run after the 401 check).
        job_queue: the queue of a job (None for an unknown job: the route
            answers 404); a blocking call, run in a worker thread.
    """

    def __init__(self, app: ASGIApp, tokens: Tokens,
                 job_queue: Callable[[str], str | None]) -> None:
        self.app = app
        self.tokens = tokens
        self.job_queue = job_queue

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                authorization = value.decode("latin-1")
        principal = self.tokens.resolve(authorization)
        if principal is None:  # TokenCheck answered already, unless the order changed
            await send_error(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        scope.setdefault("state", {})["principal"] = principal
        if not principal.admin:
            refusal = await self._refusal(principal, scope["method"], scope["path"])
            if refusal is not None:
                await send_error(send, 403, refusal)
                return
        await self.app(scope, receive, send)

    async def _refusal(self, principal: Principal, method: str, path: str) -> str | None:
        path = path.rstrip("/") or path
        if (method, path) in _OPEN_TO_SCOPED:
            return None
        job = _JOB_PATH.match(path)
        if job is not None:
            job_id = job.group(1)
            try:
                validate_id(job_id, what="job id")
            except InvalidIdentifierError:
                return None  # the route answers 422
            queue = await anyio.to_thread.run_sync(self.job_queue, job_id)
            if queue is None or principal.may_use(queue):
                return None
            return principal.refusal(queue, f"job {job_id}")
        queue_path = _QUEUE_PATH.match(path)
        if queue_path is not None and method == "GET":
            name = queue_path.group(1)
            return None if principal.may_use(name) else principal.refusal(name)
        what = "manage queues" if path.startswith("/v1/queues") else (
            "manage nodes" if path.startswith("/v1/nodes") else f"call {method} {path}")
        return (f"only the admin token may {what}; this token may use only queue(s) "
                f"{', '.join(sorted(principal.queues or ()))}")
