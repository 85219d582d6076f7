"""Know within milliseconds that a peer's process died: a TCP socket per peer.

When a process dies, even by SIGKILL, the kernel closes its sockets and the
other end reads end-of-file (or a reset) at once. tidal's job runners use
that as their fastest failure detector, beside the lease that catches a hung
or cut-off node:

* every runner listens on a :class:`LivenessServer` (an ephemeral port on the
  address its peers reach it at) and publishes the port in its rendezvous
  record;
* once a round is formed, a runner keeps one connection open to each of its
  ring peers (a few successors in rank order: rendezvous.elastic.assigned_state)
  through a :class:`PeerMonitor`, which reports the peer lost on end-of-file or
  error, and keeps the connections that stay from one round to the next;
* before waiting for a member that has not re-joined, a runner :func:`probe`\\s
  it: a refused connection means its runner is gone (its host still answers),
  so nobody waits for its lease to run out.

Nothing is ever sent but a newline from the connecting side; the server
discards what it reads. A stopped (SIGSTOP) or cut-off peer keeps its sockets
open or silent: that is what the lease is for.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Probe(enum.Enum):
    ALIVE = "alive"  # it accepted a connection
    DEAD = "dead"  # its host refused: nothing listens on that port any more
    UNKNOWN = "unknown"  # no answer in time (cut off, overloaded): ask its lease


def probe(addr: str, port: int, *, timeout_s: float = 0.5) -> Probe:
    """Try to connect to a peer's liveness port."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return Probe.ALIVE
    except ConnectionRefusedError:
        return Probe.DEAD
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
            return Probe.DEAD
        return Probe.UNKNOWN


def _closed(sock: socket.socket) -> bool:
    """Read what a readable socket holds; True if its peer closed it (or it broke)."""
    try:
        return not sock.recv(4096)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class LivenessServer:
    """Accept peers' connections and hold them open until this process ends.

    Args:
        addr: the address to listen on (the one peers reach this node at).
    """

    def __init__(self, addr: str, *, name: str = "liveness-server") -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((addr, 0))
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.addr = addr
        self.port: int = self._sock.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            for key, _ in self._selector.select():
                if key.data == "wake":
                    return
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if sock is self._sock:
                    try:
                        conn, _ = self._sock.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._selector.register(conn, selectors.EVENT_READ, "peer")
                    continue
                if _closed(sock):
                    self._selector.unregister(sock)
                    sock.close()

    def close(self) -> None:
        """Stop listening and drop every connection: peers see this node gone."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_w.close()


class PeerMonitor:
    """Hold a connection to each peer and call ``on_lost(peer)`` when one drops.

    Args:
        on_lost: called once per lost peer, from the monitor's thread.
        connect_timeout_s: how long a connection attempt may take; a peer that
            does not answer in time is left to its lease.
    """

    def __init__(
        self, on_lost: Callable[[str], None], *, connect_timeout_s: float = 1.0,
        name: str = "peer-monitor",
    ) -> None:
        self._on_lost = on_lost
        self._timeout = connect_timeout_s
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, peers: dict[str, tuple[str, int]]) -> None:
        """Watch ``peers`` (name -> (addr, port)) and no other peer.

        A peer already watched at the same address keeps its connection (a ring
        kept across rounds changes only where a peer was lost or came). A peer
        that refuses the connection is reported lost at once.
        """
        kept: set[str] = set()
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.data is None:
                    continue
                name, addr, port = key.data
                if peers.get(name) == (addr, port):
                    kept.add(name)
                    continue
                self._selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
        for name, (addr, port) in peers.items():
            if name in kept:
                continue
            try:
                sock = socket.create_connection((addr, port), timeout=self._timeout)
                sock.sendall(b"\n")
            except OSError as exc:
                if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
                    log.info("peer %s refused its liveness connection: lost", name)
                    self._report(name)
                else:  # no answer in time: the lease decides
                    log.info("no liveness connection to peer %s (%s)", name, exc)
                continue
            sock.setblocking(False)
            with self._lock:
                self._selector.register(sock, selectors.EVENT_READ, (name, addr, port))
        self._wake_w.send(b"x")

    def clear(self) -> None:
        """Stop watching every peer."""
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    self._selector.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]

    def _report(self, name: str) -> None:
        try:
            self._on_lost(name)
        except Exception:
            log.exception("the on_lost callback raised for peer %s", name)

    def _run(self) -> None:
        while not self._stopped.is_set():
            events = self._selector.select()
            for key, _ in events:
                if key.data is None:  # woken: the peer set changed, or closing
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if not _closed(sock):
                    continue
                with self._lock:
                    if sock.fileno() == -1 or sock not in (
                        k.fileobj for k in self._selector.get_map().values()
                    ):
                        continue  # cleared meanwhile
                    self._selector.unregister(sock)
                    sock.close()
                log.info("liveness connection to peer %s closed: lost", key.data[0])
                self._report(key.data[0])

    def close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.clear()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
