"""An in-memory stand-in for the etcd client facade, for the agent's unit tests.

It has only what :class:`agent.runner.status.StatusReporter` and
:class:`agent.node.metrics.JobStatusCollector` use: ``keys``, ``get``, ``put`` and
``config.timeout_s``, with the real client's parameters and result types
(tests/unit/agent/test_fakes.py holds it to that). Everything above unit
level uses a real etcd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from rendezvous.etcd import KeyValue
from rendezvous.keys import Keys
from rendezvous.records import JobNodeStatus


@dataclass
class FakeEtcd:
    keys: Keys = field(default_factory=lambda: Keys("/tidal-unit"))
    data: dict[str, bytes] = field(default_factory=dict)
    puts: int = 0
    revision: int = 1
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(timeout_s=1.0))
    _versions: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # create, mod, version

    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        value = self.data.get(key)
        if value is None:
            return None
        # A value a test wrote into ``data`` directly counts as written once, at revision 1.
        create, mod, version = self._versions.get(key, (1, 1, 1))
        return KeyValue(key, value, create, mod, version, 0)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        self.revision += 1
        create, _, version = self._versions.get(key, (self.revision, 0, 0))
        self._versions[key] = (create, self.revision, version + 1)
        self.data[key] = value
        self.puts += 1
        return self.revision

    def put_status(self, status: JobNodeStatus) -> None:
        self.put(self.keys.status(status.job_id, status.node_id), status.model_dump_json().encode())

    def status(self, job_id: str, node_id: str) -> JobNodeStatus:
        return JobNodeStatus.model_validate_json(self.data[self.keys.status(job_id, node_id)])
