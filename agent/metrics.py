"""The agent's Prometheus metrics, on an injected registry.

Per-job figures live in etcd (the runners' status records) and in the
workers' progress files; a custom collector reads them at scrape time, so a
scrape always shows the current state and nothing is double-counted across
runner restarts. Names follow Prometheus conventions: ``tidal_`` prefix, base
units, ``_total`` for counters; labels are bounded (job and node ids are
validated identifiers, reasons and states are enums).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rendezvous.client import EtcdClient
from rendezvous.errors import EtcdError
from rendezvous.records import JobNodeState, JobNodeStatus

log = logging.getLogger(__name__)


class JobStatusCollector(Collector):
    """Exports this node's job status records from etcd at scrape time.

    Args:
        client: the agent's etcd client.
        node_id: this node.
        job_ids: returns the ids of the jobs this node runs or ran.
    """

    def __init__(
        self, client: EtcdClient, node_id: str, job_ids: Callable[[], Iterable[str]]
    ) -> None:
        self._client = client
        self._node_id = node_id
        self._job_ids = job_ids

    def _statuses(self) -> list[JobNodeStatus]:
        out = []
        for job_id in sorted(set(self._job_ids())):
            kv = self._client.get(self._client.keys.status(job_id, self._node_id))
            if kv is not None:
                out.append(JobNodeStatus.model_validate_json(kv.value))
        return out

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        world = GaugeMetricFamily(
            "tidal_agent_job_world_size", "World size of the job's current round.", labels=["job"]
        )
        state = GaugeMetricFamily(
            "tidal_agent_job_state",
            "1 for the state this node's share of the job is in.",
            labels=["job", "state"],
        )
        restarts = CounterMetricFamily(
            "tidal_agent_job_restarts",
            "Worker group restarts on this node, by reason.",
            labels=["job", "reason"],
        )
        step = GaugeMetricFamily(
            "tidal_agent_job_step", "Last training step the workers reported.", labels=["job"]
        )
        ckpt = GaugeMetricFamily(
            "tidal_agent_job_checkpoint_step",
            "Step of the last checkpoint the workers reported.",
            labels=["job"],
        )
        exit_code = GaugeMetricFamily(
            "tidal_agent_job_last_failure_exit_code",
            "Exit code of the first failing worker of the job's last failure on this node.",
            labels=["job"],
        )
        try:
            statuses = self._statuses()
        except (EtcdError, ValueError) as exc:
            log.warning("metrics: cannot read job status from etcd: %s", exc)
            statuses = []
        for st in statuses:
            world.add_metric([st.job_id], st.world_size)
            for candidate in JobNodeState:
                active = 1.0 if st.state == candidate else 0.0
                state.add_metric([st.job_id, candidate.value], active)
            for reason, count in st.restart_reasons.items():
                restarts.add_metric([st.job_id, reason], count)
            if st.last_step is not None:
                step.add_metric([st.job_id], st.last_step)
            if st.last_checkpoint_step is not None:
                ckpt.add_metric([st.job_id], st.last_checkpoint_step)
            if st.error is not None:
                exit_code.add_metric([st.job_id], st.error.exit_code)
        yield from (world, state, restarts, step, ckpt, exit_code)


class AgentMetrics:
    """The agent process's own metrics plus the job collector."""

    def __init__(self, registry: CollectorRegistry, *, slots: int) -> None:
        self.registry = registry
        self.up = Gauge("tidal_agent_up", "1 while the agent runs.", registry=registry)
        self.slots = Gauge("tidal_agent_slots", "Worker processes this node may run.",
                           registry=registry)
        self.slots_used = Gauge("tidal_agent_slots_used", "Worker processes assigned now.",
                                registry=registry)
        self.started = Gauge("tidal_agent_start_time_seconds", "Unix time the agent started.",
                             registry=registry)
        self.up.set(1)
        self.slots.set(slots)
        self.started.set(time.time())

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve /metrics on ``port`` (0 picks one: read it from the server)."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        return server, thread
