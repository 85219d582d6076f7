"""An in-memory stand-in for the etcd client facade, for the agent's unit tests.

It has only what :class:`agent.status.StatusReporter` and
:class:`agent.metrics.JobStatusCollector` use: ``keys``, ``get``, ``put`` and
``config.timeout_s``. Everything above unit level uses a real etcd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from rendezvous.keys import Keys
from rendezvous.records import JobNodeStatus


@dataclass
class FakeEtcd:
    keys: Keys = field(default_factory=lambda: Keys("/tidal-unit"))
    data: dict[str, bytes] = field(default_factory=dict)
    puts: int = 0
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(timeout_s=1.0))

    def get(self, key: str) -> SimpleNamespace | None:
        value = self.data.get(key)
        return None if value is None else SimpleNamespace(key=key, value=value)

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value
        self.puts += 1

    def put_status(self, status: JobNodeStatus) -> None:
        self.put(self.keys.status(status.job_id, status.node_id), status.model_dump_json().encode())

    def status(self, job_id: str, node_id: str) -> JobNodeStatus:
        return JobNodeStatus.model_validate_json(self.data[self.keys.status(job_id, node_id)])
