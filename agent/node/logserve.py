"""Serve this node's job logs to the coordinator over HTTP, behind a bearer token.

The workers' output stays where torch elastic writes it, one file per worker
and attempt (``RUN_DIR/jobs/JOB/gen-G/logs/<run>/attempt_K/<local_rank>/
{stdout,stderr}.log``, see :func:`find_log_files`). :class:`LogServer`
answers one route::

    GET /v1/jobs/<job_id>/logs?rank=R&tail=N&follow=0|1&after_generation=G
    Authorization: Bearer <the token of this agent's node record>

with JSON lines (``application/x-ndjson``), read from the files a block at a
time (a large log is never held whole):

* ``{"generation": G, "attempt": K, "rank": R, "stream": "stdout", "line": "..."}``
  for each line of output (``rank`` is the local rank: the worker's index on
  this node; a line over :data:`MAX_LINE_BYTES` comes in pieces);
* ``{"heartbeat": true}`` after :data:`HEARTBEAT_S` without output while
  following, so that the reader can tell a quiet job from a dead agent;
* ``{"end": true}`` last, once everything asked for was sent. A stream that
  stops without it was cut (the agent died or the connection broke).

Without ``follow`` the stream ends at the files' current end. With it, new
lines (and new attempts' and generations' files) are sent as they are
written, until the job has nothing left on this node: no runner, no runner
waiting to be settled, no assignment (see ``Agent._job_active``); then what
is left is sent, partial last lines included, and the stream ends. ``tail``
keeps the last N lines of each file of the newest attempt (older attempts are
skipped); ``after_generation`` leaves out generations up to G (a reader that
follows a node again after it left and rejoined the job has seen those).

The token is made at random when the agent starts and travels in the node's
record in etcd (:class:`rendezvous.registry.LogEndpoint`), which only etcd's
clients (the coordinator) can read: nothing is served without it, and the job
id is checked (``keys.validate_id``) before it becomes a path. The other way
round, the answer proves the server holds the token too (``X-Tidal-Proof``,
an HMAC of the coordinator's ``X-Tidal-Nonce``), so the coordinator reads logs
only from the node's own agent.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from agent import rundir
from rendezvous.keys import InvalidIdentifierError
from rendezvous.node_logs import (
    NONCE_HEADER,
    PROOF_HEADER,
    BadRequestError,
    log_proof,
    parse_log_query,
)

log = logging.getLogger(__name__)

LOG_STREAMS = ("stdout", "stderr")
#: Bytes read from a file at a time.
READ_BLOCK = 64 * 1024
#: A line longer than this is sent in pieces of this size.
MAX_LINE_BYTES = 64 * 1024
#: How often a followed job's files are looked at.
POLL_S = 0.25
#: Seconds of silence after which a follower gets a heartbeat.
HEARTBEAT_S = 5.0


def new_token() -> str:
    """A fresh random bearer token for this agent's log server."""
    return secrets.token_urlsafe(32)


# the run directory's logs --------------------------------------------------------------


@dataclass(frozen=True)
class LogFile:
    """One worker's stdout or stderr of one attempt, in this agent's run directory."""

    generation: int
    run_mtime: float
    run: str
    attempt: int
    rank: int
    stream: str
    path: Path

    @property
    def group(self) -> tuple[int, str, int]:
        """The attempt this file belongs to: generation, torch's run directory, attempt."""
        return (self.generation, self.run, self.attempt)

    def sort_key(self) -> tuple[Any, ...]:
        return (self.generation, self.run_mtime, self.run, self.attempt, self.rank,
                LOG_STREAMS.index(self.stream))


def _number(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def find_log_files(
    run_dir: Path, job_id: str, *, rank: int | None = None, after_generation: int = 0
) -> list[LogFile]:
    """Every worker log file of ``job_id`` under ``run_dir``, oldest attempt first.

    Raises:
        InvalidIdentifierError: ``job_id`` is not a valid id (it would become a path).
    """
    found = []
    for generation, gen_dir in rundir.generations(run_dir, job_id):
        if generation <= after_generation:
            continue
        for run_path in rundir.logs_dir(gen_dir).glob("*"):
            try:
                run_mtime = run_path.stat().st_mtime
            except OSError:
                continue
            for path in run_path.glob("attempt_*/*/*.log"):
                attempt = _number(path.parent.parent.name, "attempt_")
                local = _number(path.parent.name, "")
                stream = path.stem
                if attempt is None or local is None or stream not in LOG_STREAMS:
                    continue
                if (rank is not None and local != rank) or path.is_symlink():
                    continue
                found.append(LogFile(generation, run_mtime, run_path.name, attempt, local,
                                     stream, path))
    return sorted(found, key=LogFile.sort_key)


def tail_offset(path: Path, lines: int, *, block: int = READ_BLOCK) -> int:
    """The byte offset where the last ``lines`` lines of ``path`` start.

    Reads backwards a block at a time, so a large log costs only its tail.
    """
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if lines <= 0 or end == 0:
            return end
        f.seek(end - 1)
        # A final newline ends the last line; it does not start another one.
        pos = end - 1 if f.read(1) == b"\n" else end
        needed = lines
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            idx = len(chunk)
            while (idx := chunk.rfind(b"\n", 0, idx)) >= 0:
                needed -= 1
                if needed == 0:
                    return start + idx + 1
            pos = start
        return 0


@dataclass
class _Reader:
    file: LogFile
    offset: int
    partial: bytes = b""


def _record(f: LogFile, raw: bytes) -> dict[str, Any]:
    return {"generation": f.generation, "attempt": f.attempt, "rank": f.rank,
            "stream": f.stream, "line": raw.decode("utf-8", errors="replace").rstrip("\r")}


def _drain(reader: _Reader, *, final: bool) -> Iterator[dict[str, Any]]:
    """The complete lines written to the reader's file since its offset, a block at a time."""
    try:
        handle = open(reader.file.path, "rb")  # noqa: SIM115 - closed below, across yields
    except OSError:
        return
    with handle:
        try:
            size = os.fstat(handle.fileno()).st_size
        except OSError:
            return
        if size < reader.offset:  # rotated (copied to NAME.1 and truncated): start over
            reader.offset, reader.partial = 0, b""
        handle.seek(reader.offset)
        while True:
            block = handle.read(READ_BLOCK)
            if not block:
                break
            reader.offset += len(block)
            lines = (reader.partial + block).split(b"\n")
            reader.partial = lines.pop()
            for raw in lines:
                yield _record(reader.file, raw)
            while len(reader.partial) >= MAX_LINE_BYTES:
                piece, reader.partial = (reader.partial[:MAX_LINE_BYTES],
                                         reader.partial[MAX_LINE_BYTES:])
                yield _record(reader.file, piece)
    if final and reader.partial:
        piece, reader.partial = reader.partial, b""
        yield _record(reader.file, piece)


def stream_job_logs(
    run_dir: Path,
    job_id: str,
    *,
    rank: int | None = None,
    tail: int | None = None,
    follow: bool = False,
    after_generation: int = 0,
    active: Callable[[], bool] = lambda: False,
    stop: threading.Event | None = None,
    poll_s: float = POLL_S,
    heartbeat_s: float = HEARTBEAT_S,
    on_idle: Callable[[], None] = lambda: None,
) -> Iterator[dict[str, Any]]:
    """The records of the route (see the module's docstring), ``{"end": true}`` last.

    Args:
        run_dir: the agent's run directory.
        job_id: a valid job id.
        rank: only this local rank.
        tail: the last N lines of each file of the newest attempt only.
        follow: go on until ``active()`` is false (or ``stop`` is set).
        after_generation: leave out generations up to this one.
        active: whether the job may still write output on this node.
        stop: set when the server closes; the stream then ends without ``end``.
        on_idle: called before each wait for new output (the server flushes there).

    Raises:
        InvalidIdentifierError: ``job_id`` is not a valid id.
    """
    stop = stop or threading.Event()
    readers: dict[Path, _Reader] = {}
    first = True
    quiet_since = time.monotonic()
    while True:
        # Asked before the files are read: once the job is idle here, this read is the last.
        last = not follow or not active()
        files = find_log_files(run_dir, job_id, rank=rank, after_generation=after_generation)
        newest = files[-1].group if files else None
        for f in files:
            reader = readers.get(f.path)
            if reader is None:
                start = 0
                if first and tail is not None:  # files there at the start honour the tail
                    try:
                        start = (tail_offset(f.path, tail) if f.group == newest
                                 else f.path.stat().st_size)
                    except OSError:
                        continue
                reader = readers[f.path] = _Reader(f, start)
            for record in _drain(reader, final=last):
                quiet_since = time.monotonic()
                yield record
        first = False
        if last:
            yield {"end": True}
            return
        on_idle()
        if stop.wait(poll_s):
            return
        if time.monotonic() - quiet_since >= heartbeat_s:
            quiet_since = time.monotonic()
            yield {"heartbeat": True}


# the server ----------------------------------------------------------------------------


class LogServer:
    """The agent's log route on ``host:port`` (0 picks a free port), in a thread.

    Args:
        run_dir: the agent's run directory.
        token: the bearer token every request must carry.
        active: whether a job may still write output on this node (see
            :func:`stream_job_logs`); called from the server's threads.
        host: the address to listen on.
        port: the port; 0 picks one (read :attr:`port`).
    """

    def __init__(self, *, run_dir: Path, token: str, active: Callable[[str], bool],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        if len(token) < 16:
            raise ValueError("the log server's token must be at least 16 characters")
        self.run_dir = run_dir
        self.token = token
        self._expected = f"Bearer {token}".encode()
        self.active = active
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="log server", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving; streams being followed end (without their ``end`` record)."""
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def authorized(self, header: str | None) -> bool:
        return hmac.compare_digest((header or "").strip().encode(), self._expected)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(_LogHandler):
            owner = server

        return Handler


class _Unbuffered(io.RawIOBase):
    """The handler's socket file as a raw stream, for a :class:`io.BufferedWriter`."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._target.write(data)
        return len(data)


class _LogHandler(BaseHTTPRequestHandler):
    owner: LogServer
    server_version = "tidal-agent-logs"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
              ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        owner = self.owner
        if not owner.authorized(self.headers.get("Authorization")):
            self._json(401, {"error": "missing or wrong bearer token"},
                       {"WWW-Authenticate": "Bearer"})
            return
        try:
            query = parse_log_query(self.path)
        except (BadRequestError, InvalidIdentifierError) as exc:
            self._json(422, {"error": str(exc)})
            return
        if query is None:
            self._json(404, {"error": "no such route"})
            return
        nonce = self.headers.get(NONCE_HEADER, "")
        self.send_response(200)
        if 0 < len(nonce) <= 128:  # the coordinator checks that this server holds the token
            self.send_header(PROOF_HEADER, log_proof(owner.token, nonce))
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        out = io.BufferedWriter(_Unbuffered(self.wfile), buffer_size=READ_BLOCK)
        records = stream_job_logs(
            owner.run_dir, query.job_id, rank=query.rank, tail=query.tail,
            follow=query.follow, after_generation=query.after_generation,
            active=lambda: owner.active(query.job_id), stop=owner._stop, on_idle=out.flush,
        )
        with contextlib.suppress(OSError, ValueError):  # the reader went away
            for record in records:
                out.write(json.dumps(record).encode() + b"\n")
            out.flush()

    def do_POST(self) -> None:
        if not self.owner.authorized(self.headers.get("Authorization")):
            self._json(401, {"error": "missing or wrong bearer token"},
                       {"WWW-Authenticate": "Bearer"})
            return
        self._json(405, {"error": "only GET is served"})
