"""The coordinator's log route: a job's worker output, read from its nodes' agents.

``GET /v1/jobs/{job_id}/logs?node=N&rank=R&tail=T&follow=true`` (bearer token
like every /v1 call) answers ``text/plain``, streamed (chunked): one line per
line of output, prefixed ``[<node> r<rank>] `` (``rank`` is the local rank, a
worker's index on its node), and the coordinator's own news as lines starting
``[tidal] ``: a node that is gone (its logs cannot be read), an agent that
cannot be reached or whose stream broke off, a node moving to a new attempt
or generation. An unknown job is a 404 with ``{"error": ...}`` before anything
is streamed.

Each node's agent serves its files (agent.node.logserve), authenticated both ways
with the token of its node record in etcd (the coordinator sends it; the agent
answers a nonce with an HMAC keyed with it); this module opens one stream per node and
passes lines on as they come, a line at a time (nothing is held whole).
Without ``follow``, nodes come one after the other, sorted by id; with it,
their lines are interleaved as they arrive, nodes that join the job are
followed as well, and the response ends once the job has ended and every
node's agent has sent what its workers wrote. While following, an empty line
is sent after :data:`KEEPALIVE_S` of silence, so that a client can tell a
quiet job from a dead connection; clients skip empty lines (every line of
output has its prefix).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
import httpx
from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.params import Depends
from fastapi.responses import StreamingResponse

from rendezvous.keys import ID_PATTERN
from rendezvous.node_logs import MAX_TAIL, NONCE_HEADER, PROOF_HEADER, LogQuery
from rendezvous.records import JobNodeStatus
from rendezvous.registry import NodeInfo
from service.api.models import JobEvent, JobRecord
from service.coordinator.store import JobNotFoundError, JobStore

log = logging.getLogger(__name__)

#: Seconds to connect to an agent, and to wait for its next line (it sends a
#: heartbeat every 5 s while following).
AGENT_CONNECT_TIMEOUT_S = 5.0
AGENT_READ_TIMEOUT_S = 30.0
#: Seconds of silence after which a follower gets an empty line.
KEEPALIVE_S = 15.0
#: How often a follow looks at the job's record for its end and new nodes.
CHECK_S = 1.0
_QUEUE_SIZE = 1024


def output_line(node_id: str, rank: int, text: str) -> str:
    """A line of a worker's output as the route sends it (without the newline)."""
    return f"[{node_id} r{rank}] {text}"


def tidal_line(message: str) -> str:
    """The coordinator's own news, in-band."""
    return f"[tidal] {message}"


def nodes_of_job(record: JobRecord, statuses: Iterable[JobNodeStatus],
                 events: Iterable[JobEvent]) -> list[str]:
    """Every node that ran or runs the job: assigned now, reported a status, or
    named by an event (a node that left the job keeps its logs), sorted."""
    found = set(record.nodes)
    found.update(s.node_id for s in statuses)
    for event in events:
        found.update(event.nodes)
    return sorted(found)


def gone_message(node_id: str) -> str:
    return (f"node {node_id} is gone (its agent is not registered): its logs cannot be "
            "read until it is back")


# one node's stream ---------------------------------------------------------------------


_DONE = object()


@dataclass
class _Pump:
    """Reads one node's agent stream in a thread and puts lines on a queue."""

    node: NodeInfo
    job_id: str
    rank: int | None
    tail: int | None
    follow: bool
    after_generation: int
    out: queue.Queue[object]
    stop: threading.Event
    generation: int = 0  # the newest generation seen
    _group: tuple[int, int] | None = field(default=None, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> _Pump:
        self.thread = threading.Thread(target=self.run, name=f"logs of {self.node.node_id}",
                                       daemon=True)
        self.thread.start()
        return self

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def put(self, item: object) -> bool:
        """Queue ``item`` unless the response was abandoned; False then."""
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            self._read()
        except Exception:  # never take the response down; say it in-band
            log.exception("reading the logs of %s on %s failed", self.job_id, self.node.node_id)
            self.put(tidal_line(f"node {self.node.node_id}: reading its logs failed; "
                                "the coordinator's log has the details"))

    def _read(self) -> None:
        node_id = self.node.node_id
        endpoint = self.node.logs
        if endpoint is None:
            self.put(tidal_line(f"node {node_id} does not serve logs (its agent is older "
                                "than the coordinator?)"))
            return
        query = LogQuery(job_id=self.job_id, rank=self.rank, tail=self.tail,
                         follow=self.follow, after_generation=self.after_generation)
        params = query.params()
        timeout = httpx.Timeout(AGENT_READ_TIMEOUT_S, connect=AGENT_CONNECT_TIMEOUT_S)
        url = f"{endpoint.url}{query.path()}"
        nonce = secrets.token_urlsafe(24)
        ended = False
        try:
            with httpx.Client(timeout=timeout, trust_env=False) as http, http.stream(
                "GET", url, params=params,
                headers={"Authorization": f"Bearer {endpoint.token}", NONCE_HEADER: nonce},
            ) as response:
                if response.status_code != 200:
                    response.read()
                    self.put(tidal_line(f"node {node_id}'s agent refused the logs request "
                                        f"(HTTP {response.status_code}: {_error_of(response)})"))
                    return
                if not hmac.compare_digest(response.headers.get(PROOF_HEADER, ""),
                                           endpoint.proof(nonce)):
                    self.put(tidal_line(f"node {node_id}: the server at {endpoint.url} did not "
                                        "prove it is the node's agent; its answer is not read"))
                    return
                for raw in response.iter_lines():
                    if self.stop.is_set():
                        return
                    if not raw:
                        continue
                    ended = self._handle(json.loads(raw)) or ended
                    if ended:
                        break
        except httpx.HTTPError as exc:
            if self.stop.is_set():
                return
            what = "cannot reach" if isinstance(exc, httpx.ConnectError) else "lost"
            self.put(tidal_line(f"node {node_id}: {what} its agent at {endpoint.url} "
                                f"({type(exc).__name__}: {exc}); the node may be gone"))
            return
        if not ended and not self.stop.is_set():
            self.put(tidal_line(f"node {node_id}: its agent's stream broke off before the "
                                "end; the node may be gone"))

    def _handle(self, record: dict[str, Any]) -> bool:
        """Pass one record of the agent's stream on; True for its end."""
        if record.get("end"):
            return True
        if "line" not in record:
            return False  # a heartbeat
        generation, attempt = int(record["generation"]), int(record["attempt"])
        self.generation = max(self.generation, generation)
        group = (generation, attempt)
        if self._group is not None and group != self._group:
            self.put(tidal_line(f"node {self.node.node_id}: generation {generation}, "
                                f"attempt {attempt}"))
        self._group = group
        self.put(output_line(self.node.node_id, int(record["rank"]), str(record["line"])))
        return False


def _error_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return " ".join(response.text.split())[:200]
    return str(body.get("error", "")) if isinstance(body, dict) else ""


# the response --------------------------------------------------------------------------


@dataclass(frozen=True)
class LogRequest:
    """The route's parameters, checked by FastAPI."""

    job_id: str
    node: str | None = None
    rank: int | None = None
    tail: int | None = None
    follow: bool = False


class JobLogs:
    """The lines of one request, as an iterator of encoded lines (see the module's docstring).

    Args:
        store: etcd access.
        request: what was asked.
        clock: monotonic seconds (tests).
    """

    def __init__(self, store: JobStore, request: LogRequest,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.request = request
        self.clock = clock
        self.out: queue.Queue[object] = queue.Queue(maxsize=_QUEUE_SIZE)
        self.stop = threading.Event()
        self.pumps: dict[str, _Pump] = {}
        self.said_gone: set[str] = set()
        self.notes: list[str] = []  # [tidal] lines to send next
        self.ran: set[str] = set()  # the nodes known to have run the job

    def first_nodes(self, record: JobRecord) -> list[str]:
        """The nodes to read at first: every node that ran the job, or the one asked for."""
        ran = nodes_of_job(record, self.store.statuses(record.job_id).values(),
                           self.store.events(record.job_id))
        self.ran.update(ran)
        if self.request.node is not None:
            return [self.request.node]
        return ran

    def _absent(self, node_id: str) -> str:
        """Why ``node_id``'s logs cannot be read: it is gone, or it never ran the job."""
        if node_id in self.ran:
            return tidal_line(gone_message(node_id))
        return tidal_line(f"node {node_id} is not registered and has not run job "
                          f"{self.request.job_id}")

    def _pump(self, node: NodeInfo, *, after: int, tail: int | None) -> _Pump:
        r = self.request
        return _Pump(node=node, job_id=r.job_id, rank=r.rank, tail=tail, follow=r.follow,
                     after_generation=after, out=self.out, stop=self.stop)

    def __iter__(self) -> Iterator[bytes]:
        """Encoded lines; an empty chunk now and then while there is nothing to send."""
        try:
            record, _ = self.store.get(self.request.job_id)
            if self.request.follow:
                yield from self._follow(record)
            else:
                yield from self._once(record)
        except JobNotFoundError:
            yield self._encode(tidal_line(f"job {self.request.job_id} no longer exists"))
        finally:
            self.stop.set()

    async def stream(self, gone: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        """The lines for a response, each read in a worker thread (they wait on the
        nodes' streams). ``gone`` tells whether the client went away; it is asked
        whenever nothing came for a moment (an empty chunk from :meth:`__iter__`),
        so that the nodes' streams close then, not when the job ends."""
        lines = iter(self)
        try:
            while True:
                chunk = await anyio.to_thread.run_sync(next, lines, None)
                if chunk is None:
                    return
                if chunk:
                    yield chunk
                elif await gone():
                    return
        finally:
            self.stop.set()

    @staticmethod
    def _encode(line: str) -> bytes:
        return line.encode("utf-8", errors="replace") + b"\n"

    def _once(self, record: JobRecord) -> Iterator[bytes]:
        live = self.store.nodes()
        for node_id in self.first_nodes(record):
            node = live.get(node_id)
            if node is None:
                yield self._encode(self._absent(node_id))
                continue
            pump = self._pump(node, after=0, tail=self.request.tail).start()
            while True:
                try:
                    item = self.out.get(timeout=0.5)
                except queue.Empty:
                    if not pump.running and self.out.empty():
                        break
                    yield b""  # nothing for now: the response checks on its client
                    continue
                yield self._encode(str(item))

    def _follow(self, record: JobRecord) -> Iterator[bytes]:
        live = self.store.nodes()
        for node_id in self.first_nodes(record):
            self._open(node_id, live, tail=self.request.tail)
        yield from self._flush_notes()
        last_sent = last_check = self.clock()
        while True:
            try:
                item: object | None = self.out.get(timeout=0.25)
            except queue.Empty:
                item = None
            now = self.clock()
            if item is not None:
                last_sent = now
                yield self._encode(str(item))
            elif now - last_sent >= KEEPALIVE_S:
                last_sent = now
                yield b"\n"
            else:
                yield b""  # nothing for now: the response checks on its client
            if now - last_check < CHECK_S:
                continue
            last_check = now
            record, _ = self.store.get(self.request.job_id)
            if not record.phase.is_terminal():
                live = self.store.nodes()
                for node_id in sorted(record.nodes):
                    if self.request.node in (None, node_id):
                        self._open(node_id, live, tail=None)
                yield from self._flush_notes()
                continue
            # A job that started and ended between two checks: read the nodes it ran on.
            unread = [n for n in self.first_nodes(record)
                      if n not in self.pumps and n not in self.said_gone]
            if unread:
                live = self.store.nodes()
                for node_id in unread:
                    self._open(node_id, live, tail=None)
                yield from self._flush_notes()
            elif not any(p.running for p in self.pumps.values()) and self.out.empty():
                return

    def _open(self, node_id: str, live: dict[str, NodeInfo], *, tail: int | None) -> None:
        """Follow ``node_id`` unless a stream of it is open; say once that it is gone."""
        pump = self.pumps.get(node_id)
        if pump is not None and pump.running:
            return
        node = live.get(node_id)
        if node is None:
            if node_id not in self.said_gone:
                self.said_gone.add(node_id)
                self.notes.append(self._absent(node_id))
            return
        self.said_gone.discard(node_id)
        # A node followed again (it left the job and came back) starts after what it sent.
        after = pump.generation if pump is not None else 0
        self.pumps[node_id] = self._pump(node, after=after, tail=tail).start()

    def _flush_notes(self) -> Iterator[bytes]:
        while self.notes:
            yield self._encode(self.notes.pop(0))


def logs_router(*, store: JobStore, auth: Depends) -> APIRouter:
    """The log route, for ``app.include_router`` (``auth``: the API's token check)."""
    router = APIRouter()

    @router.get(
        "/v1/jobs/{job_id}/logs", dependencies=[auth], tags=["jobs"],
        response_class=StreamingResponse,
        responses={200: {"content": {"text/plain": {}},
                         "description": "Lines prefixed [<node> r<rank>]; [tidal] lines "
                                        "are the coordinator's."}},
    )
    def job_logs(
        request: Request,
        job_id: Annotated[str, PathParam(pattern=ID_PATTERN, description="A job id.")],
        node: Annotated[str | None, Query(pattern=ID_PATTERN,
                                          description="Only this node's workers.")] = None,
        rank: Annotated[int | None, Query(ge=0, le=65535,
                                          description="Only this local rank.")] = None,
        tail: Annotated[int | None, Query(ge=0, le=MAX_TAIL,
                                          description="The last N lines of each worker's "
                                                      "newest attempt.")] = None,
        follow: Annotated[bool, Query(description="Go on until the job ends.")] = False,
    ) -> StreamingResponse:
        """The workers' output, streamed from the nodes' agents (see this module)."""
        store.get(job_id)  # 404 for an unknown job, before anything is streamed
        body = JobLogs(store, LogRequest(job_id=job_id, node=node, rank=rank, tail=tail,
                                         follow=follow))
        return StreamingResponse(body.stream(request.is_disconnected),
                                 media_type="text/plain; charset=utf-8",
                                 headers={"Cache-Control": "no-store",
                                          "X-Content-Type-Options": "nosniff"})

    return router
