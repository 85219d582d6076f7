"""One coordinator process: the API, the reconcile loop and the election, wired together.

:class:`Coordinator` is the composition root: it builds the etcd client, the
store, the metrics registry, the election and the reconcile loop from one
:class:`CoordinatorSettings`, and serves the API with uvicorn. Several
replicas may run against one etcd: all serve the API, the elected one
reconciles.
"""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from rendezvous.election import Election
from rendezvous.etcd import EtcdClient, create_client_waiting
from service.coordinator.app import create_app
from service.coordinator.metrics import ClusterCollector, CoordinatorMetrics
from service.coordinator.reconciler import Reconciler
from service.coordinator.routes.access import load_queue_tokens
from service.coordinator.settings import CoordinatorSettings
from service.coordinator.store import JobStore, Snapshot
from service.scheduler import Policy

log = logging.getLogger(__name__)

ELECTION_NAME = "coordinator"


class Coordinator:
    """Build it with settings; :meth:`start` the loop, then :meth:`serve` (blocks).

    Args:
        settings: this process's configuration.
    """

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.token = settings.resolve_token()
        tokens_file = settings.queue_tokens_file
        self.queue_tokens = load_queue_tokens(tokens_file) if tokens_file is not None else {}
        # etcd may start after the coordinator, or be too loaded to answer at once.
        self.client: EtcdClient = create_client_waiting(settings.etcd_config())
        self.store = JobStore(self.client)
        self.registry = CollectorRegistry()
        self.metrics = CoordinatorMetrics(self.registry)
        self.election = Election(
            self.client, ELECTION_NAME,
            value=settings.replica_id.encode(),
            ttl_s=settings.election_ttl_s,
        )
        self.reconciler = Reconciler(
            self.store, self.election, self.metrics, interval_s=settings.reconcile_interval_s,
            policy=Policy(straggler_cooldown_s=settings.straggler_cooldown_s),
        )
        self.registry.register(ClusterCollector(self._snapshot))
        self.app: FastAPI = create_app(
            store=self.store,
            metrics=self.metrics,
            registry=self.registry,
            token=self.token,
            workdir_root=settings.workdir_root,
            checkpoint_root=settings.checkpoint_root,
            election=self.election,
            max_body_bytes=settings.max_body_bytes,
            queue_tokens=self.queue_tokens,
            on_change=self.reconciler.wake,
            reconcile_problem=self.reconciler.problem,
            grafana_url=settings.grafana_url,
        )
        self.server: uvicorn.Server | None = None
        self.url = ""
        self._stopped = threading.Event()

    def _snapshot(self) -> Snapshot | None:
        return self.reconciler.last_snapshot

    def start(self) -> Coordinator:
        self.reconciler.start()
        return self

    def bind(self) -> socket.socket:
        """Bind the API's socket now (port 0 picks a free one); sets :attr:`url`."""
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted
        # connections only when the socket says it is TCP. Without it a reply
        # written in two parts waits for the client's delayed ACK: 40 ms per
        # request on a kept-alive connection.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.settings.host, self.settings.port))
        sock.listen(1024)
        sock.set_inheritable(True)
        port = sock.getsockname()[1]
        host = f"[{self.settings.host}]" if family == socket.AF_INET6 else self.settings.host
        self.url = f"http://{host}:{port}"
        self.election.value = f"{self.settings.replica_id} {self.url}".encode()
        return sock

    def serve(self, sock: socket.socket | None = None) -> None:
        """Serve the API until :meth:`stop` (or SIGINT/SIGTERM, which uvicorn handles)."""
        sock = sock or self.bind()
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        try:
            self.server.run(sockets=[sock])
        finally:
            sock.close()
            self.close()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    def close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.reconciler.stop()
        self.client.close()
