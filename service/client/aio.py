"""tidal's Python client for asyncio: :class:`AsyncClient`, the twin of
:class:`service.client.sync.Client` (the same arguments, methods and errors, each method
awaited; its ``logs`` is an async iterator). Import it from :mod:`service.client.sync`,
which re-exports it; what the two share is :class:`service.client.base.ClientBase`
and :mod:`service.client.calls`. This module never imports torch or the agent.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Mapping
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
from service.client.errors import ApiError, check_outcome


class AsyncClient(ClientBase):
    """:class:`Client`'s twin for asyncio: the same arguments, methods and errors,
    each method awaited; :meth:`logs` is an async iterator. Use it as an async
    context manager, or await :meth:`aclose`.

    ``transport`` is an ``httpx.AsyncBaseTransport``.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        state_dir: Path | str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, state_dir=state_dir, timeout=timeout)
        self._http = httpx.AsyncClient(transport=transport, **self._http_options())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def _run(self, call: Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, json=call.json,
                                                params=call.params)
        except httpx.HTTPError as exc:
            raise self._transport_failure(exc) from exc
        return self._answer(call, response)

    async def submit(self, spec: JobSpec | Mapping[str, Any] | None = None, /, **fields: Any
                     ) -> JobView:
        """See :meth:`Client.submit`."""
        return await self._run(submit_call(build_spec(spec, **fields)))

    async def get(self, job_id: str) -> JobView:
        """See :meth:`Client.get`."""
        return await self._run(get_call(job_id))

    async def list_page(self, *, phase: JobPhase | str | None = None, limit: int | None = None,
                        cursor: str | None = None) -> JobList:
        """See :meth:`Client.list_page`."""
        return await self._run(list_page_call(phase, limit, cursor))

    async def iter_jobs(self, *, phase: JobPhase | str | None = None, page_size: int = 500
                        ) -> AsyncIterator[JobView]:
        """See :meth:`Client.iter_jobs`."""
        pager = Pager()
        while True:
            page = await self.list_page(phase=phase, limit=page_size, cursor=pager.cursor)
            for view in page.jobs:
                yield view
            if not pager.advance(page):
                return

    async def list(self, *, phase: JobPhase | str | None = None) -> builtins.list[JobView]:
        """See :meth:`Client.list`."""
        return [view async for view in self.iter_jobs(phase=phase)]

    async def wait(
        self, job_id: str, *, timeout: float | None = None, check: bool = False,
        poll_interval: float = POLL_INTERVAL_S,
    ) -> JobView:
        """See :meth:`Client.wait`."""
        loop = asyncio.get_running_loop()
        waiter = Waiter(job_id, loop.time(), timeout)
        while True:
            try:
                if waiter.seen(await self.get(job_id)):
                    assert waiter.last is not None
                    return check_outcome(waiter.last) if check else waiter.last
            except ApiError as exc:
                waiter.failed(exc, loop.time())
            waiter.check_deadline(loop.time())
            await asyncio.sleep(poll_interval)

    async def logs(
        self, job_id: str, *, node: str | None = None, rank: int | None = None,
        tail: int | None = None, follow: bool = False,
    ) -> AsyncIterator[str]:
        """The job's workers' output, a line at a time, each prefixed ``[NODE rRANK] ``.

        Args:
            job_id: the job.
            node: only this node's workers.
            rank: only this rank.
            tail: only the last ``tail`` lines of each worker's output.
            follow: keep yielding new lines until the job ends.

        A node that is gone is said in a line starting ``[tidal] ``.

        Raises:
            NotFoundError: there is no such job.
            UnavailableError: the coordinator could not be reached, or the
                stream broke off.
        """
        params = logs_params(node=node, rank=rank, tail=tail, follow=follow)
        try:
            async with self._http.stream(
                "GET", job_path(job_id, "/logs"), params=params,
                headers={"Accept": "text/plain"}, timeout=self._stream_timeouts(follow),
            ) as response:
                if not response.is_success:
                    await response.aread()
                    raise self._refusal(response)
                async for line in response.aiter_lines():
                    # An empty line is the coordinator's keep-alive
                    # (service.coordinator.routes.logs).
                    if line:
                        yield line
        except httpx.HTTPError as exc:
            raise self._transport_failure(exc) from exc

    async def events(self, job_id: str) -> EventList:
        """See :meth:`Client.events`."""
        return await self._run(events_call(job_id))

    async def scale(self, job_id: str, *, min_nodes: int | None = None,
                    max_nodes: int | None = None) -> JobView:
        """See :meth:`Client.scale`."""
        return await self._run(scale_call(job_id, min_nodes, max_nodes))

    async def cancel(self, job_id: str) -> JobView:
        """See :meth:`Client.cancel`."""
        return await self._run(cancel_call(job_id))

    async def nodes(self) -> builtins.list[NodeView]:
        """See :meth:`Client.nodes`."""
        return await self._run(nodes_call())

    async def drain(self, node_id: str) -> NodeView:
        """See :meth:`Client.drain`."""
        return await self._run(drain_call(node_id, on=True))

    async def undrain(self, node_id: str) -> NodeView:
        """See :meth:`Client.undrain`."""
        return await self._run(drain_call(node_id, on=False))

    async def queues(self) -> QueueList:
        """See :meth:`Client.queues`."""
        return await self._run(queues_call())

    async def create_queue(self, name: str, *, guaranteed: int = 0, limit: int | None = None,
                           weight: float = 1.0) -> QueueChanged:
        """See :meth:`Client.create_queue`."""
        return await self._run(create_queue_call(name, guaranteed=guaranteed, limit=limit,
                                                 weight=weight))

    async def update_queue(self, name: str, **changes: Any) -> QueueChanged:
        """See :meth:`Client.update_queue`."""
        return await self._run(update_queue_call(name, changes))

    async def delete_queue(self, name: str) -> QueueView:
        """See :meth:`Client.delete_queue`."""
        return await self._run(delete_queue_call(name))
