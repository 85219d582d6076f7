"""The coordinator's side of one node's log stream, against real HTTP servers on
loopback: the node's agent (agent.node.logserve) and an impostor that took its address."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.node.logserve import LogServer
from rendezvous.registry import LogEndpoint, NodeInfo
from service.coordinator.routes.logs import _Pump

JOB = "train-0123abcd"
TOKEN = "k" * 32


def _pump(url: str, token: str = TOKEN) -> list[str]:
    node = NodeInfo(node_id="a", logs=LogEndpoint(url=url, token=token))
    out: queue.Queue[object] = queue.Queue()
    pump = _Pump(node=node, job_id=JOB, rank=None, tail=None, follow=False,
                 after_generation=0, out=out, stop=threading.Event()).start()
    assert pump.thread is not None
    pump.thread.join(timeout=30)
    return [str(out.get()) for _ in range(out.qsize())]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[str]:
    log = tmp_path / "jobs" / JOB / "gen-1" / "logs" / "run" / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text("hello\n")
    server = LogServer(run_dir=tmp_path, token=TOKEN, active=lambda _: False).start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.close()


class _Impostor(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"generation": 1, "attempt": 0, "rank": 0, "stream": "stdout",
                           "line": "forged"}).encode() + b"\n" + b'{"end": true}\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_the_nodes_agent_is_read_and_proves_it_holds_the_token(agent: str) -> None:
    assert _pump(agent) == ["[a r0] hello"]


def test_a_wrong_token_is_refused_in_band(agent: str) -> None:
    lines = _pump(agent, token="w" * 32)
    assert len(lines) == 1 and lines[0].startswith("[tidal] node a's agent refused"), lines
    assert "HTTP 401" in lines[0]


def test_a_server_that_cannot_prove_it_is_the_agent_is_not_read() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        lines = _pump(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert len(lines) == 1 and "did not prove it is the node's agent" in lines[0], lines


def test_an_agent_that_is_not_there_is_said_in_band() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), _Impostor) as closed:
        port = closed.server_address[1]
    lines = _pump(f"http://127.0.0.1:{port}")
    assert len(lines) == 1 and lines[0].startswith("[tidal] node a: cannot reach its agent")
