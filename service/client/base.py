"""What :class:`service.client.sync.Client` and :class:`service.client.aio.AsyncClient` share:
the coordinator's address and token (:func:`service.client.target.resolve_target`), the
headers and timeouts of a request, and how an answer becomes a result and a refusal
or a transport failure becomes one of :mod:`service.client.errors`. The two clients differ
only in how they send. This module never imports torch or the agent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from service.client.calls import Call
from service.client.errors import ApiError, UnavailableError, api_error
from service.client.target import resolve_target

DEFAULT_TIMEOUT_S = 10.0
# A coordinator that does not accept a connection within this is down or
# unreachable; there is no point waiting the full request timeout for it.
MAX_CONNECT_TIMEOUT_S = 5.0
USER_AGENT = "tidal-client"
# Seconds without a byte (the coordinator sends a keep-alive every 15 s) before a
# followed log is given up as a dead connection.
LOGS_FOLLOW_READ_TIMEOUT_S = 60.0

T = TypeVar("T")


class ClientBase:
    """What both clients share: configuration, headers, and turning answers into
    results and failures into :mod:`service.client.errors`."""

    def __init__(
        self, url: str | None, token: str | None, *, state_dir: Path | str | None, timeout: float,
    ) -> None:
        target = resolve_target(url, token, None if state_dir is None else Path(state_dir))
        self.url = target.url
        self.target = target
        self.timeout = timeout
        self._headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if target.token is not None:
            self._headers["Authorization"] = f"Bearer {target.token}"
        self._timeouts = httpx.Timeout(timeout, connect=min(timeout, MAX_CONNECT_TIMEOUT_S))

    def _http_options(self) -> dict[str, Any]:
        return {"base_url": self.url, "headers": self._headers, "timeout": self._timeouts,
                "follow_redirects": False}

    def _stream_timeouts(self, follow: bool) -> httpx.Timeout:
        # Following, the coordinator sends an empty line after 15 s of silence:
        # a minute without one is a dead connection, not a quiet job.
        read = max(self.timeout, LOGS_FOLLOW_READ_TIMEOUT_S) if follow else self.timeout
        return httpx.Timeout(self.timeout, connect=min(self.timeout, MAX_CONNECT_TIMEOUT_S),
                             read=read)

    def _transport_failure(self, exc: httpx.HTTPError) -> UnavailableError:
        if isinstance(exc, httpx.TimeoutException):
            return UnavailableError(f"the coordinator at {self.url} did not answer within "
                                    f"{self.timeout:g} s ({type(exc).__name__})", status=0)
        reason = str(exc) or type(exc).__name__
        return UnavailableError(f"cannot reach the coordinator at {self.url}: {reason}",
                                status=0)

    def _refusal(self, response: httpx.Response) -> ApiError:
        """The error for a non-2xx answer (its body must have been read)."""
        status = response.status_code
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            detail = body.get("detail")
            return api_error(status, body["error"],
                             detail=detail if isinstance(detail, list) else None)
        text = " ".join(response.text.split())[:200]
        return api_error(status, f"HTTP {status} from {self.url}" + (f": {text}" if text else ""))

    def _answer(self, call: Call[T], response: httpx.Response) -> T:
        if not response.is_success:
            raise self._refusal(response)
        try:
            data = response.json()
        except ValueError as exc:
            raise UnavailableError(f"the coordinator at {self.url} answered {call.method} "
                                   f"{call.path} with something that is not JSON",
                                   status=0) from exc
        try:
            return call.answer.validate_python(data)
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise UnavailableError(
                f"the coordinator at {self.url} sent an answer this client does not "
                f"understand ({where}: {first['msg']}); are the versions the same?",
                status=0) from exc
