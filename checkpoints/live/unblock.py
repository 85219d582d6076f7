"""Getting a worker out of a gloo collective blocked on a peer that hangs (no FIN).

A peer whose process is killed closes its sockets and gloo raises in the
survivors within about 0.15 s. A peer that hangs (SIGSTOP, a host that froze
or lost its network) sends nothing: the survivors' collective waits for the
group's timeout, and nothing in torch 2.13 cuts it short for gloo
(``ProcessGroup.abort()`` and ``shutdown()`` are no-ops for gloo, ``set_timeout``
applies to later operations only, ``shrink_group`` is NCCL-only; see
docs/architecture.md, "In-place recovery"). What does work: shutting down
(``shutdown(SHUT_RDWR)``) the group's *connected* TCP sockets from another
thread; gloo's transport then fails the blocked operation at once ("Connection
closed by peer") and the process goes on. The listening socket must be left
alone: gloo aborts the process when its ``accept`` fails. On NCCL the same
notice aborts the default group's communicators, the group recorded with the
sockets (:func:`checkpoints.nccl.default_nccl_group`): the blocked collective
raises ``DistBackendError`` and the group stays registered until ``rejoin``
replaces it.

:class:`Unblocker` is a daemon thread that does this when the runner's
``live-lost.json`` appears (:mod:`checkpoints.protocol.live`), on the sockets
the process held when its process groups were last formed
(:func:`connected_tcp_sockets`, recorded by :meth:`Unblocker.record`): the
training group's and the checkpointer's private groups' pairs and their store
client. Sockets the script opens later are not touched; sockets it held
before its process group was made are (the group's cannot be told from them).
The checkpointer marks a notice handled before it abandons a group, so a
notice never reaches the next group's sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from checkpoints.nccl import default_nccl_group
from checkpoints.protocol.live import LOST_NOTICE, read_lost_notice

__all__ = ["Unblocker", "connected_tcp_sockets"]

log = logging.getLogger("checkpoints.live")  # the name it always logged under

_POLL_S = 0.02


def _socket_inode(fd: int) -> int | None:
    with contextlib.suppress(OSError):
        link = os.readlink(f"/proc/self/fd/{fd}")
        if link.startswith("socket:["):
            return int(link[len("socket:["):-1])
    return None


def _fds() -> list[int]:
    with contextlib.suppress(OSError):
        return [int(name) for name in os.listdir("/proc/self/fd") if name.isdigit()]
    return []


def _connected_tcp(fd: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it is a connected TCP socket (the caller closes it)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.getpeername()  # a listener has no peer: never shut it down
            return sock
    except OSError:
        pass
    sock.close()
    return None


def connected_tcp_sockets() -> set[int]:
    """The inodes of this process's connected TCP sockets (Linux ``/proc``; empty elsewhere)."""
    found = set()
    for fd in _fds():
        inode = _socket_inode(fd)
        if inode is None:
            continue
        sock = _connected_tcp(fd)
        if sock is not None:
            sock.close()
            found.add(inode)
    return found


def shut_down(inodes: set[int]) -> int:
    """Shut down (both ways) this process's connected TCP sockets among ``inodes``; how many."""
    count = 0
    for fd in _fds():
        if _socket_inode(fd) not in inodes:
            continue
        sock = _connected_tcp(fd)
        if sock is None:
            continue
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        sock.close()
    return count


class Unblocker:
    """Shuts the group's connected sockets down when the runner says a member is lost.

    Args:
        directory: the progress directory (where ``live-lost.json`` appears).
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._inodes: set[int] = set()
        self._nccl: Any = None  # the NCCL group to abort, as recorded with the sockets
        self._handled = time.time()  # a notice older than this process's groups is stale
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="checkpoint-unblock",
                                        daemon=True)

    def start(self) -> Unblocker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def record(self) -> None:
        """The process groups were (re-)formed: their sockets are the ones held now."""
        inodes = connected_tcp_sockets()
        group = default_nccl_group()
        with self._lock:
            self._inodes, self._nccl = inodes, group

    def handled(self) -> None:
        """The group is being abandoned: the lost notice there is now is dealt with."""
        notice = read_lost_notice(self._directory)
        with self._lock:
            self._inodes, self._nccl = set(), None
            if notice is not None:
                self._handled = max(self._handled, notice.written_at)

    def _watch(self) -> None:
        path = self._directory / LOST_NOTICE
        while not self._stop.wait(_POLL_S):
            try:
                os.stat(path)
            except OSError:
                continue
            notice = read_lost_notice(self._directory)
            if notice is None:
                continue
            with self._lock:
                if notice.written_at <= self._handled:
                    continue
                self._handled = notice.written_at
                count = shut_down(self._inodes)
                aborted = self._abort_nccl()
            log.warning("a member of round %d is lost: shut down %d socket(s) of the process "
                        "group%s, so that a collective blocked on it returns", notice.round, count,
                        " and aborted its NCCL communicators" if aborted else "")

    def _abort_nccl(self) -> bool:
        """Abort the recorded NCCL group (under the lock: never one formed after it)."""
        if self._nccl is None:
            return False
        try:
            self._nccl.abort()
        except Exception:  # the group went away meanwhile: nothing blocks on it
            log.warning("aborting the NCCL communicators failed", exc_info=True)
            return False
        return True
