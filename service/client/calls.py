"""What a call of tidal's API is, shared by :class:`service.client.sync.Client` and its
asyncio twin: job specs (:func:`build_spec`), one :class:`Call` builder per route (method,
path, body, the model of the answer), and the bookkeeping of a wait for a job's end
(:class:`Waiter`) and of a walk through every job's pages (:class:`Pager`). Nothing here
sends anything; this module never imports torch or the agent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import TypeAdapter, ValidationError

from service.api.models import EventList, JobList, JobPhase, JobSpec, JobView, NodeView
from service.api.queues import QueueChanged, QueueList, QueueView
from service.client.errors import ApiError, InvalidSpecError, WaitTimeoutError

POLL_INTERVAL_S = 0.5
# While waiting for a job, a coordinator that restarts or loses etcd for a
# moment is waited for this long before the wait gives up.
OUTAGE_TOLERANCE_S = 30.0

T = TypeVar("T")

_JOB_VIEW: TypeAdapter[JobView] = TypeAdapter(JobView)
_JOB_LIST: TypeAdapter[JobList] = TypeAdapter(JobList)
_EVENT_LIST: TypeAdapter[EventList] = TypeAdapter(EventList)
_NODE_VIEW: TypeAdapter[NodeView] = TypeAdapter(NodeView)
_NODE_LIST: TypeAdapter[list[NodeView]] = TypeAdapter(list[NodeView])
_QUEUE_LIST: TypeAdapter[QueueList] = TypeAdapter(QueueList)
_QUEUE_CHANGED: TypeAdapter[QueueChanged] = TypeAdapter(QueueChanged)
_QUEUE_VIEW: TypeAdapter[QueueView] = TypeAdapter(QueueView)


# job specs -----------------------------------------------------------------------------


def default_name(command: list[str] | tuple[str, ...]) -> str:
    """A job name from its command: ``python train.py`` -> ``train``."""
    words = list(command)
    if words and re.match(r"^(python[0-9.]*|torchrun|uv|poetry)$", Path(words[0]).name):
        rest = [w for w in words[1:] if not w.startswith("-")]
        words = rest or words
    stem = Path(words[0]).stem if words else "job"
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")[:40]
    return name or "job"


def spec_error(exc: ValidationError) -> InvalidSpecError:
    """An invalid job spec as one sentence naming each field; values are never
    echoed (an ``env`` value may be a secret)."""
    fields = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'job'}: {err['msg']}"
        for err in exc.errors()[:5]
    )
    return InvalidSpecError(f"invalid job: {fields}")


def build_spec(spec: JobSpec | Mapping[str, Any] | None = None, /, **fields: Any) -> JobSpec:
    """A validated job spec from a spec or mapping with ``fields`` over it.

    A missing ``name`` comes from the command (:func:`default_name`), as on the
    command line. Fields left out stay unset, so the coordinator's defaults apply.

    Raises:
        InvalidSpecError: a field is missing or invalid (exit 2); nothing was sent.
    """
    if isinstance(spec, JobSpec):
        base: dict[str, Any] = spec.model_dump(exclude_unset=True)
    else:
        base = dict(spec or {})
    base.update(fields)
    if "name" not in base and isinstance(base.get("command"), (list, tuple)):
        base["name"] = default_name(base["command"])
    if "max_nodes" not in base and isinstance(base.get("min_nodes"), int):
        base["max_nodes"] = base["min_nodes"]  # as `tidal submit`: a fixed size unless told
    try:
        return JobSpec.model_validate(base)
    except ValidationError as exc:
        raise spec_error(exc) from None


# calls ---------------------------------------------------------------------------------


def job_path(job_id: str, suffix: str = "") -> str:
    # Quoted whole, so an id like "../nodes" stays one path segment (and gets a 404/422).
    return f"/v1/jobs/{quote(job_id, safe='')}{suffix}"


def node_path(node_id: str) -> str:
    return f"/v1/nodes/{quote(node_id, safe='')}/drain"


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call: what to send and the model of the answer."""

    method: str
    path: str
    answer: TypeAdapter[T]
    json: Any = None
    params: Mapping[str, str | int] | None = None


def submit_call(spec: JobSpec) -> Call[JobView]:
    return Call("POST", "/v1/jobs", _JOB_VIEW,
                 json=spec.model_dump(mode="json", exclude_unset=True))


def get_call(job_id: str) -> Call[JobView]:
    return Call("GET", job_path(job_id), _JOB_VIEW)


def events_call(job_id: str) -> Call[EventList]:
    return Call("GET", job_path(job_id, "/events"), _EVENT_LIST)


def cancel_call(job_id: str) -> Call[JobView]:
    return Call("POST", job_path(job_id, "/cancel"), _JOB_VIEW)


def nodes_call() -> Call[list[NodeView]]:
    return Call("GET", "/v1/nodes", _NODE_LIST)


def drain_call(node_id: str, *, on: bool) -> Call[NodeView]:
    return Call("POST" if on else "DELETE", node_path(node_id), _NODE_VIEW)


def parse_phase(phase: JobPhase | str) -> JobPhase:
    try:
        return JobPhase(str(getattr(phase, "value", phase)).upper())
    except ValueError:
        raise ValueError(f"phase {phase!r} is not one of "
                         f"{', '.join(p.value for p in JobPhase)}") from None


def list_page_call(phase: JobPhase | str | None, limit: int | None, cursor: str | None
               ) -> Call[JobList]:
    params: dict[str, str | int] = {}
    if phase is not None:
        params["phase"] = parse_phase(phase).value
    if limit is not None:
        params["limit"] = limit
    if cursor is not None:
        params["cursor"] = cursor
    return Call("GET", "/v1/jobs", _JOB_LIST, params=params)


def scale_call(job_id: str, min_nodes: int | None, max_nodes: int | None) -> Call[JobView]:
    body = {k: v for k, v in (("min_nodes", min_nodes), ("max_nodes", max_nodes))
            if v is not None}
    return Call("PATCH", job_path(job_id), _JOB_VIEW, json=body)


def queue_path(name: str) -> str:
    return f"/v1/queues/{quote(name, safe='')}"


def queues_call() -> Call[QueueList]:
    return Call("GET", "/v1/queues", _QUEUE_LIST)


def create_queue_call(name: str, *, guaranteed: int, limit: int | None, weight: float
                      ) -> Call[QueueChanged]:
    body = {"name": name, "guaranteed": guaranteed, "limit": limit, "weight": weight}
    return Call("POST", "/v1/queues", _QUEUE_CHANGED, json=body)


def update_queue_call(name: str, changes: Mapping[str, Any]) -> Call[QueueChanged]:
    """``changes``: any of guaranteed, limit (None removes it), weight."""
    unknown = set(changes) - {"guaranteed", "limit", "weight"}
    if unknown:
        raise ValueError(f"a queue has no setting {', '.join(sorted(unknown))}: "
                         "change guaranteed, limit or weight")
    if not changes:
        raise ValueError("nothing to change: give guaranteed, limit or weight")
    return Call("PATCH", queue_path(name), _QUEUE_CHANGED, json=dict(changes))


def delete_queue_call(name: str) -> Call[QueueView]:
    return Call("DELETE", queue_path(name), _QUEUE_VIEW)


def logs_params(
    *, node: str | None, rank: int | None, tail: int | None, follow: bool
) -> dict[str, str | int]:
    """The query of ``GET /v1/jobs/{id}/logs`` (both clients' ``logs``)."""
    params: dict[str, str | int] = {}
    if node is not None:
        params["node"] = node
    if rank is not None:
        params["rank"] = rank
    if tail is not None:
        params["tail"] = tail
    if follow:
        params["follow"] = "true"
    return params


# waiting -------------------------------------------------------------------------------


@dataclass
class Waiter:
    """What a wait for a job's end does after each poll; the clock is passed in.

    Args:
        job_id: the job waited for.
        started: the clock's time when the wait began.
        timeout: seconds after ``started`` to give up (None: never).
        outage_tolerance: seconds a coordinator may give no answer (or 5xx)
            in a row before the wait gives up with that error.
    """

    job_id: str
    started: float
    timeout: float | None = None
    outage_tolerance: float = OUTAGE_TOLERANCE_S
    last: JobView | None = None
    outage_since: float | None = None

    def seen(self, view: JobView) -> bool:
        """Record an answer; True when the job has ended."""
        self.last = view
        self.outage_since = None
        return view.phase.is_terminal()

    def failed(self, exc: ApiError, now: float) -> None:
        """Record a failed poll.

        Raises:
            ApiError: ``exc`` itself when it is a refusal (retrying will not
                help) or the coordinator has been away too long.
        """
        if not exc.transient:
            raise exc
        if self.outage_since is None:
            self.outage_since = now
        if now - self.outage_since > self.outage_tolerance:
            raise exc

    def check_deadline(self, now: float) -> None:
        """Raises:
        WaitTimeoutError: the timeout has passed (the job goes on)."""
        if self.timeout is not None and now - self.started >= self.timeout:
            phase = f" (it is {self.last.phase.value})" if self.last is not None else ""
            raise WaitTimeoutError(
                f"job {self.job_id} did not finish within {self.timeout:g} s{phase}; it goes on",
                job_id=self.job_id, last=self.last)


@dataclass
class Pager:
    """Where a walk through every job, a page at a time, stands.

    Attributes:
        cursor: the cursor to ask the next page with (None: the first page).
    """

    cursor: str | None = None
    _seen: set[str] = field(default_factory=set)

    def advance(self, page: JobList) -> bool:
        """True if there is a page after ``page`` (:attr:`cursor` names it); False at
        the end, or when the coordinator hands out a cursor it gave before."""
        if page.next_cursor is None or page.next_cursor in self._seen:
            return False
        self._seen.add(page.next_cursor)
        self.cursor = page.next_cursor
        return True
