"""The agent's log route, the one contract between the coordinator and each agent's log server.

``GET /v1/jobs/{job_id}/logs?rank=R&tail=T&follow=1&after_generation=G`` on the
agent (its address and bearer token are in the node's record,
:class:`rendezvous.registry.LogEndpoint`). The coordinator sends a random nonce
in :data:`NONCE_HEADER`; the agent answers with :data:`PROOF_HEADER`, the
:func:`log_proof` of it under the route's token, so that the coordinator reads
logs only from the node's own agent. The body is the workers' output, one line
at a time. Both ends import this module: the server
(:mod:`agent.node.logserve`) parses with :func:`parse_log_query`, the coordinator
(:mod:`service.coordinator.routes.logs`) builds the request from a :class:`LogQuery`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from rendezvous.keys import validate_id

PATH_PREFIX = "/v1/jobs/"
PATH_SUFFIX = "/logs"
#: The most lines a ``tail`` may ask for.
MAX_TAIL = 1_000_000
#: The highest ``rank`` a query may name.
MAX_RANK = 65535

#: The headers of the log route's proof (:meth:`rendezvous.registry.LogEndpoint.proof`).
NONCE_HEADER = "X-Tidal-Nonce"
PROOF_HEADER = "X-Tidal-Proof"


def log_proof(token: str, nonce: str) -> str:
    """HMAC-SHA256 of ``nonce`` keyed with the log route's ``token``, in hex."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def logs_path(job_id: str) -> str:
    """The route's path for ``job_id`` (validated: it becomes part of a URL).

    Raises:
        InvalidIdentifierError: ``job_id`` is not a valid id.
    """
    return f"{PATH_PREFIX}{validate_id(job_id, what='job id')}{PATH_SUFFIX}"


class BadRequestError(ValueError):
    """A query the route does not accept; the message names the parameter."""


@dataclass(frozen=True)
class LogQuery:
    """The route's parameters, checked."""

    job_id: str
    rank: int | None = None
    tail: int | None = None
    follow: bool = False
    after_generation: int = 0

    def path(self) -> str:
        """The route's path for this job."""
        return logs_path(self.job_id)

    def params(self) -> dict[str, str | int]:
        """The query string's parameters, as :func:`parse_log_query` reads them."""
        params: dict[str, str | int] = {"follow": "1" if self.follow else "0",
                                        "after_generation": self.after_generation}
        if self.rank is not None:
            params["rank"] = self.rank
        if self.tail is not None:
            params["tail"] = self.tail
        return params


def _int_param(params: dict[str, list[str]], name: str, low: int, high: int) -> int | None:
    values = params.get(name)
    if not values:
        return None
    text = values[-1]
    digits = text[1:] if text.startswith("-") else text
    if not digits.isdigit() or len(digits) > len(str(high)):
        raise BadRequestError(f"{name} must be an integer")
    value = int(text)
    if not low <= value <= high:
        raise BadRequestError(f"{name} ({value}) must be between {low} and {high}")
    return value


def parse_log_query(target: str) -> LogQuery | None:
    """The route's parameters from a request target; None when the path is not the route.

    Raises:
        BadRequestError: a parameter is malformed or out of range.
        InvalidIdentifierError: the job id is not a valid id.
    """
    parts = urlsplit(target)
    path = parts.path
    if not (path.startswith(PATH_PREFIX) and path.endswith(PATH_SUFFIX)):
        return None
    job_id = path[len(PATH_PREFIX):-len(PATH_SUFFIX)]
    if "/" in job_id:
        return None
    params = parse_qs(parts.query, keep_blank_values=True)
    follow = params.get("follow", ["0"])[-1].lower()
    if follow not in ("0", "1", "true", "false"):
        raise BadRequestError("follow must be 0, 1, true or false")
    return LogQuery(
        job_id=validate_id(job_id, what="job id"),
        rank=_int_param(params, "rank", 0, MAX_RANK),
        tail=_int_param(params, "tail", 0, MAX_TAIL),
        follow=follow in ("1", "true"),
        after_generation=_int_param(params, "after_generation", 0, 2**62) or 0,
    )
