"""The Python client's decisions without a coordinator: which error (and exit code)
an answer becomes, how a wait decides, and how a job spec is built.

The answers come from an ``httpx.MockTransport`` (an HTTP exchange written
out, not a stand-in for a process); every method against a real coordinator is
in tests/integration/service/client/test_client.py.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest

from service.api.models import JobPhase, JobView
from service.cli.common import cli_error
from service.client import (
    EXIT_JOB_CANCELLED,
    EXIT_JOB_FAILED,
    EXIT_NOT_CONFIGURED,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    PHASE_EXIT,
    ApiError,
    AsyncClient,
    Client,
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    InvalidSpecError,
    JobCancelledError,
    JobFailedError,
    NotConfiguredError,
    NotFoundError,
    RefusedError,
    TidalError,
    UnauthorizedError,
    UnavailableError,
    WaitTimeoutError,
    build_spec,
    check_outcome,
    exit_code,
)
from service.client.calls import Waiter
from service.client.errors import api_error

URL = "http://coordinator.test"


def _view(phase: str = "RUNNING", **extra: Any) -> dict[str, Any]:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()
    return {
        "job_id": "train-0123abcd",
        "spec": {"name": "train", "command": ["python", "train.py"], "working_dir": None,
                 "env_names": [], "min_nodes": 1, "max_nodes": 2, "nproc_per_node": 1,
                 "checkpoint_dir": None, "max_restarts": 3, "node_selector": {},
                 "priority": 0, "resize_policy": None, "grace_period_s": 30.0},
        "phase": phase, "cancel_requested": False, "conditions": [], "world_size": 0,
        "nodes": [], "restarts": {}, "restart_count": 0, "last_step": None,
        "last_checkpoint_step": None, "exit_reason": None, "error": None,
        "created_at": now, "started_at": None, "finished_at": None, **extra,
    }


def _client(handler: Any) -> Client:
    return Client(URL, "token", transport=httpx.MockTransport(handler))


def _answer(status: int, body: Any = None, *, text: str | None = None) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        if text is not None:
            return httpx.Response(status, text=text)
        return httpx.Response(status, json=body)
    return handler


@pytest.mark.parametrize(("status", "cls", "code"), [
    (401, UnauthorizedError, EXIT_REFUSED),
    (403, ForbiddenError, EXIT_REFUSED),
    (404, NotFoundError, EXIT_REFUSED),
    (409, ConflictError, EXIT_REFUSED),
    (413, InvalidRequestError, EXIT_REFUSED),
    (422, InvalidRequestError, EXIT_REFUSED),
    (418, RefusedError, EXIT_REFUSED),
    (500, UnavailableError, EXIT_UNREACHABLE),
    (503, UnavailableError, EXIT_UNREACHABLE),
])
def test_a_refusal_becomes_its_class_with_the_servers_message_and_the_cli_exit_code(
    status: int, cls: type[ApiError], code: int,
) -> None:
    body = {"error": f"said with {status}", "detail": [{"loc": ["body", "x"], "msg": "bad"}]}
    with _client(_answer(status, body)) as client, pytest.raises(cls) as caught:
        client.get("train-0123abcd")
    err = caught.value
    assert type(err) is cls
    assert (err.status, err.message, err.exit_code) == (status, f"said with {status}", code)
    assert err.detail == [{"loc": ["body", "x"], "msg": "bad"}]
    assert err.transient == (status >= 500)


def test_an_answer_without_an_error_body_is_named_by_status_and_text() -> None:
    with _client(_answer(404, text="<html>no\n such   page</html>")) as client, \
            pytest.raises(NotFoundError, match=r"HTTP 404 from http://coordinator.test: "
                                               r"<html>no such page</html>"):
        client.nodes()


def test_an_answer_this_client_cannot_read_is_unavailable_not_a_validation_error() -> None:
    with _client(_answer(200, {"job_id": 3})) as client, \
            pytest.raises(UnavailableError, match="does not understand") as caught:
        client.get("x")
    assert caught.value.status == 0 and caught.value.exit_code == EXIT_UNREACHABLE
    with _client(_answer(200, text="not json")) as client, \
            pytest.raises(UnavailableError, match="not JSON"):
        client.cancel("x")


def test_no_answer_is_unavailable_and_transient() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with _client(refuse) as client, pytest.raises(UnavailableError, match="cannot reach") as c:
        client.list()
    assert (c.value.status, c.value.unreachable, c.value.transient) == (0, True, True)
    with _client(slow) as client, pytest.raises(UnavailableError, match="did not answer within"):
        client.events("x")


def test_the_async_client_maps_answers_the_same_way() -> None:
    async def run() -> None:
        transport = httpx.MockTransport(_answer(409, {"error": "job x is already CANCELLED"}))
        async with AsyncClient(URL, "t", transport=transport) as client:
            with pytest.raises(ConflictError, match="already CANCELLED"):
                await client.cancel("x")

        def refuse(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("refused", request=request)

        async with AsyncClient(URL, "t", transport=httpx.MockTransport(refuse)) as client:
            with pytest.raises(UnavailableError):
                await client.get("x")
            with pytest.raises(UnavailableError):
                async for _ in client.logs("x"):
                    pass
        transport = httpx.MockTransport(_answer(404, {"error": "job x does not exist"}))
        async with AsyncClient(URL, "t", transport=transport) as client:
            with pytest.raises(NotFoundError, match="does not exist"):
                async for _ in client.logs("x", follow=True):
                    pass

    asyncio.run(run())


def test_requests_carry_the_token_and_quote_ids_into_one_path_segment() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=_view())

    with _client(handler) as client:
        client.get("../nodes")
        client.scale("a b", max_nodes=3)
    assert seen[0].headers["authorization"] == "Bearer token"
    assert seen[0].url.raw_path == b"/v1/jobs/..%2Fnodes"
    assert (seen[1].method, seen[1].url.raw_path, seen[1].content) == (
        "PATCH", b"/v1/jobs/a%20b", b'{"max_nodes":3}')


def test_every_error_class_maps_to_its_cli_exit_code_through_one_table() -> None:
    cases: list[tuple[TidalError, int]] = [
        (InvalidSpecError("invalid job: min_nodes: too small"), EXIT_USAGE),
        (NotConfiguredError("no tidal coordinator configured"), EXIT_NOT_CONFIGURED),
        (api_error(404, "job x does not exist"), EXIT_REFUSED),
        (api_error(0, "cannot reach"), EXIT_UNREACHABLE),
        (api_error(503, "etcd is unavailable"), EXIT_UNREACHABLE),
        (WaitTimeoutError("job x did not finish", job_id="x"), EXIT_TIMEOUT),
        (JobFailedError("job x FAILED", view=JobView.model_validate(_view("FAILED"))),
         EXIT_JOB_FAILED),
        (JobCancelledError("job x was CANCELLED",
                           view=JobView.model_validate(_view("CANCELLED"))), EXIT_JOB_CANCELLED),
    ]
    for err, code in cases:
        shown = cli_error(err)
        assert (err.exit_code, shown.exit_code, shown.message) == (code, code, err.message)
    wrong_token = cli_error(api_error(401, "missing or wrong bearer token"))
    assert wrong_token.exit_code == EXIT_REFUSED and "TIDAL_TOKEN" in wrong_token.message
    assert PHASE_EXIT == {JobPhase.SUCCEEDED: 0, JobPhase.FAILED: EXIT_JOB_FAILED,
                          JobPhase.CANCELLED: EXIT_JOB_CANCELLED}


def test_check_outcome_raises_for_a_job_that_did_not_succeed() -> None:
    ok = JobView.model_validate(_view("SUCCEEDED"))
    assert check_outcome(ok) is ok and exit_code(ok) == 0
    assert exit_code(JobView.model_validate(_view("RUNNING"))) is None
    failed = JobView.model_validate(_view("FAILED", exit_reason="worker_failed", error={
        "rank": 0, "exit_code": 3, "message": "boom"}))
    with pytest.raises(JobFailedError, match="job train-0123abcd FAILED: boom") as caught:
        check_outcome(failed)
    assert caught.value.view is failed and caught.value.job_id == "train-0123abcd"
    with pytest.raises(JobCancelledError):
        check_outcome(JobView.model_validate(_view("CANCELLED")))


def test_a_wait_tolerates_a_short_outage_and_gives_up_on_a_long_one_or_a_refusal() -> None:
    waiter = Waiter("j", started=100.0, timeout=None, outage_tolerance=30.0)
    gone = api_error(0, "cannot reach")
    waiter.failed(gone, now=101.0)
    waiter.failed(api_error(503, "etcd is unavailable"), now=130.0)
    assert not waiter.seen(JobView.model_validate(_view("RUNNING")))  # the outage is over
    waiter.failed(gone, now=140.0)
    with pytest.raises(UnavailableError):
        waiter.failed(gone, now=170.5)
    with pytest.raises(NotFoundError):
        Waiter("j", started=0.0).failed(api_error(404, "no such job"), now=0.0)
    assert waiter.seen(JobView.model_validate(_view("SUCCEEDED")))


def test_a_wait_times_out_with_the_last_phase_seen() -> None:
    waiter = Waiter("j", started=10.0, timeout=5.0)
    waiter.check_deadline(14.9)
    waiter.seen(JobView.model_validate(_view("RUNNING")))
    with pytest.raises(WaitTimeoutError, match=r"within 5 s \(it is RUNNING\); it goes on") as c:
        waiter.check_deadline(15.0)
    assert c.value.last is not None and c.value.exit_code == EXIT_TIMEOUT
    Waiter("j", started=0.0).check_deadline(1e9)  # no timeout: never


def test_build_spec_names_the_job_after_its_command_and_fixes_its_size_by_default() -> None:
    spec = build_spec(command=["python", "train.py", "--lr", "0.1"], min_nodes=2)
    assert (spec.name, spec.min_nodes, spec.max_nodes) == ("train", 2, 2)
    assert spec.model_fields_set == {"name", "command", "min_nodes", "max_nodes"}
    over = build_spec({"name": "a", "command": ["x"], "max_nodes": 4}, max_nodes=2)
    assert (over.name, over.max_nodes) == ("a", 2)
    assert build_spec(spec, priority=5).priority == 5


def test_an_invalid_spec_names_the_fields_never_the_values() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        build_spec(command=["x"], min_nodes=3, max_nodes=1, env={"TOKEN": "hunter2" * 10000})
    message = caught.value.message
    assert message.startswith("invalid job: ") and caught.value.exit_code == EXIT_USAGE
    assert "hunter2" not in message
    with pytest.raises(InvalidSpecError, match="name"):
        build_spec({"command": "not a list"})


def test_a_client_without_a_url_anywhere_is_not_configured(tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    for name in ("TIDAL_URL", "TIDAL_TOKEN", "TIDAL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(NotConfiguredError, match="no tidal coordinator configured") as c:
        Client(state_dir=tmp_path)
    assert c.value.exit_code == EXIT_NOT_CONFIGURED
    with pytest.raises(ValueError, match="phase 'runing' is not one of"):
        _client(_answer(200, {"jobs": []})).list(phase="runing")


def test_logs_come_a_line_at_a_time_without_the_keepalive_lines_and_with_the_query() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text="[a r0] one\n\n[a r0] two\r\n[tidal] node b is gone\n")

    want = ["[a r0] one", "[a r0] two", "[tidal] node b is gone"]
    with _client(handler) as client:
        assert list(client.logs("j", node="a", rank=0, tail=5, follow=True)) == want

    async def run() -> list[str]:
        async with AsyncClient(URL, "t", transport=httpx.MockTransport(handler)) as client:
            return [line async for line in client.logs("j", node="a", rank=0, tail=5,
                                                        follow=True)]

    assert asyncio.run(run()) == want
    assert seen[0].url.params == seen[1].url.params == httpx.QueryParams(
        node="a", rank="0", tail="5", follow="true")
    assert seen[1].headers["accept"] == "text/plain"
