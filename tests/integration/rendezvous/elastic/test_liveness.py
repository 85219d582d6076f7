"""Liveness sockets (rendezvous.elastic.liveness), real listening sockets on loopback: a closed
port is dead at once; a dropped connection is reported."""

from __future__ import annotations

import socket
import threading

from rendezvous.elastic.liveness import LivenessServer, PeerMonitor, Probe, probe


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_probe_tells_a_listening_port_from_a_closed_one() -> None:
    server = LivenessServer("127.0.0.1")
    try:
        assert probe("127.0.0.1", server.port) is Probe.ALIVE
    finally:
        server.close()
    assert probe("127.0.0.1", server.port) is Probe.DEAD
    assert probe("127.0.0.1", _closed_port()) is Probe.DEAD


def test_the_monitor_reports_a_peer_whose_server_closes_and_only_that_one() -> None:
    lost: list[str] = []
    seen = threading.Event()

    def on_lost(name: str) -> None:
        lost.append(name)
        seen.set()

    one, two = LivenessServer("127.0.0.1"), LivenessServer("127.0.0.1")
    monitor = PeerMonitor(on_lost)
    try:
        monitor.watch({"one": ("127.0.0.1", one.port), "two": ("127.0.0.1", two.port)})
        one.close()
        assert seen.wait(10)
        assert lost == ["one"]
    finally:
        monitor.close()
        two.close()


def test_a_refused_peer_is_reported_at_once_and_cleared_peers_never() -> None:
    lost: list[str] = []
    server = LivenessServer("127.0.0.1")
    monitor = PeerMonitor(lost.append)
    try:
        monitor.watch({"gone": ("127.0.0.1", _closed_port())})
        assert lost == ["gone"]
        monitor.watch({"kept": ("127.0.0.1", server.port)})
        monitor.clear()
        server.close()
        # Nothing may arrive for a cleared peer: a new watch round-trips the
        # monitor's thread, after which any report would have been made.
        monitor.watch({})
        assert lost == ["gone"]
    finally:
        monitor.close()
        server.close()
