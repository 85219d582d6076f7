"""Both clients walk every page of jobs through service.client.calls.Pager."""

from __future__ import annotations

import asyncio

import httpx

from service.api.models import JobList
from service.client import AsyncClient, Client
from service.client.calls import Pager
from tests.unit.service.client.test_client import URL
from tests.unit.service.client.test_client import _view as view

# Three pages, the last handing out the first page's cursor again.
PAGES = {
    None: (["a-0000000a", "b-0000000b"], "c1"),
    "c1": (["c-0000000c"], "c2"),
    "c2": (["d-0000000d"], "c1"),
}


def _pages(request: httpx.Request) -> httpx.Response:
    ids, cursor = PAGES[request.url.params.get("cursor")]
    assert request.url.params["limit"] == "2"
    return httpx.Response(200, json={"jobs": [view(job_id=i) for i in ids], "next_cursor": cursor})


def test_a_pager_follows_the_cursors_and_stops_at_the_end_or_a_repeated_one() -> None:
    pager = Pager()
    assert pager.cursor is None
    assert pager.advance(JobList(jobs=[], next_cursor="c1")) and pager.cursor == "c1"
    assert pager.advance(JobList(jobs=[], next_cursor="c2")) and pager.cursor == "c2"
    assert not pager.advance(JobList(jobs=[], next_cursor="c1"))
    assert not Pager().advance(JobList(jobs=[]))


def test_both_clients_list_every_page_once() -> None:
    expected = ["a-0000000a", "b-0000000b", "c-0000000c", "d-0000000d"]
    with Client(URL, "token", transport=httpx.MockTransport(_pages)) as client:
        assert [v.job_id for v in client.iter_jobs(page_size=2)] == expected

    async def walk() -> list[str]:
        transport = httpx.MockTransport(_pages)
        async with AsyncClient(URL, "token", transport=transport) as client:
            return [v.job_id async for v in client.iter_jobs(page_size=2)]

    assert asyncio.run(walk()) == expected
