"""`tidal up`'s supervisor: the coordinator and agents a :class:`service.up.cluster.LocalCluster`
runs, and the thread that starts one again when it dies.

:class:`Supervisor` holds the children behind one lock (the supervisor thread and
the caller's thread both change them) and makes the supervisor thread's pass
(:meth:`Supervisor.supervise_once`): note the deaths
(:meth:`service.up.children.SupervisedChild.note_exit`, scheduled by the cluster's
:class:`service.up.children.RestartPolicy`), start the restarts that are due, and
note the restarted children that said they are ready. Without supervision an
exited agent is dropped instead (a lost node) and the coordinator's exit is
essential. The exits wait for ``tidal up`` in :meth:`Supervisor.take_exits`.

A coordinator or agent that exits while the cluster runs is started again, on
the same port and node id, after a delay that doubles with each quick death
(:class:`service.up.children.RestartPolicy`); every restart is logged. The state
is in etcd, so a new coordinator picks up where the old one was, and the jobs on
the agents never notice. Children say they are ready in a ready file
(:mod:`service.up.ready`), never through their log text. etcd is not supervised: when
it exits, the cluster stops.

How a child is started again (its command line: the same port and node id) and
what a change means for the cluster (its URL, ``cluster.json``) are the cluster's:
it passes them in as ``respawn`` and ``on_change``. Like the cluster, this module
never imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from service.up.children import ChildExit, ClusterError, RestartPolicy, SupervisedChild

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.2


class Supervisor:
    """The coordinator and agents of a cluster, and their supervision.

    Args:
        policy: how soon a dead child starts again.
        respawn: start the next incarnation of a dead child (the same name, port
            and node id) and return it; called with :attr:`lock` held.
        on_change: called with :attr:`lock` held after a pass in which restarted
            children came back (they are passed), or after an exited agent was
            dropped (an empty list).
    """

    def __init__(
        self,
        *,
        policy: RestartPolicy,
        respawn: Callable[[SupervisedChild], SupervisedChild],
        on_change: Callable[[list[SupervisedChild]], None],
    ) -> None:
        self.policy = policy
        self._respawn = respawn
        self._on_change = on_change
        # The supervisor thread and the caller's thread both change the children.
        self.lock = threading.RLock()
        self.coordinator: SupervisedChild | None = None
        self.agents: dict[str, SupervisedChild] = {}
        self._exits: list[ChildExit] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def children(self) -> list[SupervisedChild]:
        """The coordinator (once started) first, then the agents."""
        children = list(self.agents.values())
        if self.coordinator is not None:
            children.insert(0, self.coordinator)
        return children

    def agent(self, node_id: str) -> SupervisedChild:
        """The agent ``node_id``.

        Raises:
            ClusterError: no such agent runs (the message names those that do).
        """
        try:
            return self.agents[node_id]
        except KeyError:
            raise ClusterError(
                f"no agent {node_id!r} runs in this cluster (running: "
                f"{', '.join(self.agents) or 'none'})"
            ) from None

    def coordinator_pid(self) -> int | None:
        """The pid of the coordinator now running; None while it is being restarted."""
        with self.lock:
            child = self.coordinator
            if child is None or child.proc.poll() is not None:
                return None
            return child.pid

    def restarts(self, name: str) -> int:
        """How many times ``name`` (``coordinator`` or a node id) was started again."""
        with self.lock:
            child = self.coordinator if name == "coordinator" else self.agents.get(name)
            return child.restarts if child is not None else 0

    def start(self) -> None:
        """Start the supervisor thread: a pass every ``SUPERVISE_INTERVAL_S``."""
        self._thread = threading.Thread(
            target=self._loop, name="tidal-up-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, waiting for a pass under way (unless called from the thread)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def take_exits(self) -> list[ChildExit]:
        """The exits noted since the last call."""
        with self.lock:
            exits, self._exits = self._exits, []
        return exits

    def _loop(self) -> None:
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            try:
                with self.lock:
                    if self._stopping.is_set():
                        return
                    self.supervise_once(time.monotonic())
            except Exception:  # never let the supervisor die quietly
                log.exception("supervising the cluster's children failed; trying again")

    def supervise_once(self, now: float) -> None:
        """One pass: note deaths, start due restarts, note restarted children that are ready."""
        self.collect_exits(now, restart=True)
        came_back: list[SupervisedChild] = []
        for child in self.children():
            if child.restart_due(now):
                self._restart(child)
            elif child.came_back():
                came_back.append(child)
                log.warning("%s is back (pid %d, restart %d)%s", child.name, child.pid,
                            child.restarts, f", serving at {child.url}" if child.url else "")
        if came_back:
            self._on_change(came_back)

    def collect_exits(self, now: float, *, restart: bool) -> None:
        """Note the children that exited: schedule their restarts (``restart``), or
        drop an exited agent, a lost node (the coordinator's exit is then essential)."""
        policy = self.policy if restart else None
        for child in self.children():
            coordinator = child is self.coordinator
            exit_ = child.note_exit(now, policy, essential=coordinator and not restart)
            if exit_ is None:
                continue
            self._exits.append(exit_)
            if not restart and not coordinator:
                del self.agents[child.name]
                self._on_change([])

    def _restart(self, old: SupervisedChild) -> None:
        new = old.succeeded_by(self._respawn(old))
        if old is self.coordinator:
            self.coordinator = new
        else:
            self.agents[old.name] = new
