"""The new round's store port, waited for before init_process_group (checkpoints.live.group)."""

from __future__ import annotations

import socket
import threading
import time

from checkpoints.live.group import wait_for_listener


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_that_listens_is_found_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        started = time.monotonic()
        assert wait_for_listener("127.0.0.1", server.getsockname()[1], timeout_s=5)
        assert time.monotonic() - started < 5


def test_a_port_that_never_listens_gives_up_at_the_timeout() -> None:
    started = time.monotonic()
    assert not wait_for_listener("127.0.0.1", _free_port(), timeout_s=0.2)
    assert time.monotonic() - started >= 0.2


def test_a_store_that_opens_a_moment_later_is_found() -> None:
    port = _free_port()
    opened: list[float] = []
    servers: list[socket.socket] = []
    go = threading.Event()

    def open_later() -> None:
        go.wait(5)
        time.sleep(0.1)  # rank 0 comes a little late (what is measured, not a synchronisation)
        servers.append(socket.create_server(("127.0.0.1", port)))
        opened.append(time.monotonic())

    thread = threading.Thread(target=open_later)
    thread.start()
    try:
        go.set()
        assert wait_for_listener("127.0.0.1", port, timeout_s=5)
        found = time.monotonic()
    finally:
        thread.join()
        for server in servers:
            server.close()
    assert found >= opened[0]  # how soon after: tests/bench/bench_recovery_in_place.py
