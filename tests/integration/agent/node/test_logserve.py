"""The agent's log server (agent.node.logserve.LogServer), a real HTTP server on loopback:
a request without its token is refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from agent.node.logserve import LogServer
from tests.unit.agent.node.test_logserve import JOB, _log


def test_the_server_refuses_without_its_token(tmp_path: Path) -> None:
    _log(tmp_path, 1, 0, 0, "hello\n")
    token = "t" * 32
    server = LogServer(run_dir=tmp_path, token=token, active=lambda _: False).start()
    base = f"http://127.0.0.1:{server.port}/v1/jobs/{JOB}/logs"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            refused = httpx.get(base, headers=headers, timeout=5)
            assert refused.status_code == 401, headers
            assert refused.headers["www-authenticate"] == "Bearer"
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.post(base, headers={}, timeout=5).status_code == 401
        assert httpx.get(base + "?rank=x", headers=auth, timeout=5).status_code == 422
        answer = httpx.get(base, headers=auth, timeout=5)
        assert answer.status_code == 200
        records = [json.loads(line) for line in answer.text.splitlines()]
        assert records[0]["line"] == "hello" and records[-1] == {"end": True}
    finally:
        server.close()
