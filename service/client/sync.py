"""The blocking client, :class:`Client` (``TidalClient`` is its other name).

Users import it, its async twin, the errors and the cluster file's target from
the package :mod:`service.client`, whose face imports each from its home module.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from service.api.models import EventList, JobList, JobPhase, JobSpec, JobView, NodeView
from service.api.queues import QueueChanged, QueueList, QueueView
from service.client.base import DEFAULT_TIMEOUT_S, ClientBase, T
from service.client.calls import (
    POLL_INTERVAL_S,
    Call,
    Pager,
    Waiter,
    build_spec,
    cancel_call,
    create_queue_call,
    delete_queue_call,
    drain_call,
    events_call,
    get_call,
    job_path,
    list_page_call,
    logs_params,
    nodes_call,
    queues_call,
    scale_call,
    submit_call,
    update_queue_call,
)
from service.client.errors import (
    ApiError,
    check_outcome,
)

__all__ = ["Client", "TidalClient"]


class Client(ClientBase):
    """tidal's API over HTTP, one blocking call per method.

    Args:
        url: the coordinator's base URL (``http://HOST:PORT``); default
            ``TIDAL_URL``, else the cluster file of ``tidal up``.
        token: the bearer token; default ``TIDAL_TOKEN``, ``TIDAL_TOKEN_FILE``,
            else the cluster file's (for its own URL only).
        state_dir: where ``tidal up`` keeps ``cluster.json`` (default
            ``$TIDAL_HOME``, else ``~/.tidal``).
        timeout: seconds for each request (connecting takes at most 5 s of it).
        transport: an httpx transport to use instead of the network (tests).

    Raises:
        NotConfiguredError: no URL anywhere, or an unreadable token or cluster file.

    Every method raises a :class:`ApiError` subclass when the call did not
    succeed: :class:`RefusedError` (4xx) or :class:`UnavailableError`. Use it
    as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        state_dir: Path | str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, state_dir=state_dir, timeout=timeout)
        self._http = httpx.Client(transport=transport, **self._http_options())

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def _run(self, call: Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, json=call.json,
                                          params=call.params)
        except httpx.HTTPError as exc:
            raise self._transport_failure(exc) from exc
        return self._answer(call, response)

    # jobs ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec | Mapping[str, Any] | None = None, /, **fields: Any
               ) -> JobView:
        """Submit a job; it starts once ``min_nodes`` nodes are free.

        ``client.submit(name="train", command=["python", "train.py"], max_nodes=4)``,
        or a :class:`JobSpec` / mapping (a parsed job file) with ``fields`` over it.
        See :func:`build_spec` for the defaults.

        Returns:
            The new job, PENDING; its ``job_id`` names it from now on.

        Raises:
            InvalidSpecError: the spec is invalid (nothing was sent).
            RefusedError: the coordinator refused it (e.g. a path outside its roots).
        """
        return self._run(submit_call(build_spec(spec, **fields)))

    def get(self, job_id: str) -> JobView:
        """One job: phase, world size, nodes, restarts, progress, error.

        Raises:
            NotFoundError: there is no such job.
        """
        return self._run(get_call(job_id))

    get_job = get  # the command line's name for it

    def list_page(self, *, phase: JobPhase | str | None = None, limit: int | None = None,
                  cursor: str | None = None) -> JobList:
        """One page of jobs, oldest first; its ``next_cursor`` asks for the next."""
        return self._run(list_page_call(phase, limit, cursor))

    def iter_jobs(self, *, phase: JobPhase | str | None = None, page_size: int = 500
                  ) -> Iterator[JobView]:
        """Every job, oldest first, a page at a time."""
        pager = Pager()
        while True:
            page = self.list_page(phase=phase, limit=page_size, cursor=pager.cursor)
            yield from page.jobs
            if not pager.advance(page):
                return

    def list(self, *, phase: JobPhase | str | None = None) -> builtins.list[JobView]:
        """Every job (in ``phase``, e.g. ``"RUNNING"``), oldest first."""
        return builtins.list(self.iter_jobs(phase=phase))

    def wait(
        self, job_id: str, *, timeout: float | None = None, check: bool = False,
        poll_interval: float = POLL_INTERVAL_S,
    ) -> JobView:
        """Until the job ends; its final view.

        A coordinator that is away for a moment (a restart, etcd lost) is
        waited for up to 30 s in a row.

        Args:
            job_id: the job.
            timeout: seconds to wait at most (None: as long as it takes).
            check: raise :class:`JobFailedError` / :class:`JobCancelledError`
                unless the job SUCCEEDED (as ``subprocess.run(check=True)``).
            poll_interval: seconds between polls.

        Raises:
            WaitTimeoutError: ``timeout`` passed first; the job goes on (exit 7).
            JobFailedError, JobCancelledError: with ``check``, the job did not succeed.
            NotFoundError: there is no such job.
        """
        waiter = Waiter(job_id, time.monotonic(), timeout)
        while True:
            try:
                if waiter.seen(self.get(job_id)):
                    assert waiter.last is not None
                    return check_outcome(waiter.last) if check else waiter.last
            except ApiError as exc:
                waiter.failed(exc, time.monotonic())
            waiter.check_deadline(time.monotonic())
            time.sleep(poll_interval)

    def logs(
        self, job_id: str, *, node: str | None = None, rank: int | None = None,
        tail: int | None = None, follow: bool = False,
    ) -> Iterator[str]:
        """The job's workers' output, a line at a time, read by the coordinator from
        the nodes' agents (service.coordinator.routes.logs); works from any machine that reaches it.

        Each line is prefixed ``[NODE rRANK] `` (``RANK``: the worker's index on its
        node); the coordinator's own news (a node that is gone, an agent that cannot
        be reached, a node's new attempt) are lines starting ``[tidal] ``.

        Args:
            job_id: the job.
            node: only this node's workers.
            rank: only this local rank.
            tail: only the last ``tail`` lines of each worker's newest attempt.
            follow: keep yielding new lines until the job ends (and its nodes'
                last lines are in).

        Raises:
            NotFoundError: there is no such job.
            UnavailableError: the coordinator could not be reached, or the
                stream broke off.
        """
        params = logs_params(node=node, rank=rank, tail=tail, follow=follow)
        try:
            with self._http.stream(
                "GET", job_path(job_id, "/logs"), params=params,
                headers={"Accept": "text/plain"}, timeout=self._stream_timeouts(follow),
            ) as response:
                if not response.is_success:
                    response.read()
                    raise self._refusal(response)
                for line in response.iter_lines():
                    if line:  # an empty line is the coordinator's keep-alive
                        yield line
        except httpx.HTTPError as exc:
            raise self._transport_failure(exc) from exc

    def events(self, job_id: str) -> EventList:
        """The job's history, oldest first: every phase change and resize, with its reason."""
        return self._run(events_call(job_id))

    def scale(self, job_id: str, *, min_nodes: int | None = None, max_nodes: int | None = None
              ) -> JobView:
        """New bounds for the job's size. Bounds alone restart nothing; nodes a lower
        maximum releases leave as drained ones do, a higher maximum lets idle nodes
        join (live when the job's script supports it, else from the newest state).

        Raises:
            InvalidRequestError: ``min_nodes`` greater than ``max_nodes``.
            ConflictError: the job has ended or is being cancelled.
        """
        return self._run(scale_call(job_id, min_nodes, max_nodes))

    def cancel(self, job_id: str) -> JobView:
        """Cancel the job: its workers get SIGTERM (time to checkpoint), then SIGKILL.

        Returns once the cancel is recorded (``cancel_requested``); :meth:`wait`
        waits for CANCELLED.

        Raises:
            ConflictError: the job has already ended.
        """
        return self._run(cancel_call(job_id))

    # nodes -----------------------------------------------------------------------------

    def nodes(self) -> builtins.list[NodeView]:
        """The live nodes: state, slots in use, GPUs, labels and their jobs."""
        return self._run(nodes_call())

    def drain(self, node_id: str) -> NodeView:
        """Take a node out of service: its jobs checkpoint and go on without it.

        Raises:
            NotFoundError: the node is not registered.
        """
        return self._run(drain_call(node_id, on=True))

    def undrain(self, node_id: str) -> NodeView:
        """Put a drained node back in service."""
        return self._run(drain_call(node_id, on=False))

    # queues ----------------------------------------------------------------------------

    def queues(self) -> QueueList:
        """Every queue with its guarantee, limit, weight and the slots its jobs hold."""
        return self._run(queues_call())

    def create_queue(self, name: str, *, guaranteed: int = 0, limit: int | None = None,
                     weight: float = 1.0) -> QueueChanged:
        """Create a queue (admin token); the answer carries a warning when the
        guarantees add up to more than the cluster holds.

        Raises:
            ConflictError: the queue exists.
            ForbiddenError: the token is not the admin's.
        """
        return self._run(create_queue_call(name, guaranteed=guaranteed, limit=limit,
                                           weight=weight))

    def update_queue(self, name: str, **changes: Any) -> QueueChanged:
        """Change a queue's ``guaranteed``, ``limit`` (None removes it) or ``weight``.

        Raises:
            ValueError: no change, or a setting a queue does not have (nothing was sent).
            NotFoundError: there is no such queue.
        """
        return self._run(update_queue_call(name, changes))

    def delete_queue(self, name: str) -> QueueView:
        """Delete a queue (admin token).

        Raises:
            ConflictError: unfinished jobs use it.
        """
        return self._run(delete_queue_call(name))


# The command line's older name for the blocking client.
TidalClient = Client
