"""Everything in tidal that talks to etcd.

* :mod:`rendezvous.etcd`: the etcd client (factory, facade, watch stream), its
  settings and credentials (``etcd.settings``, ``etcd.auth``) and an embedded
  etcd server (``etcd.server``);
* :mod:`rendezvous.elastic`: everything torch.distributed.elastic calls: the
  agents' rendezvous handler (``elastic.assigned``, with ``assigned_join``, its
  own join record, and ``assigned_rounds``, the pure round decisions), the torchrun
  ``etcd-v3`` backend (``elastic.etcd_v3``), their c10d store (``elastic.store``)
  and peer liveness (``elastic.liveness``);
* at the root, what both the coordinator and the agents use: the key layout
  (``keys``), the records in etcd (``records``), leases, watches, leader election,
  the node registry, GPU records, errors, and the process supervisor (``child``).

Only ``elastic.etcd_v3``, ``elastic.assigned``, ``elastic.assigned_join`` and
``elastic.store`` import torch; the coordinator and the agent daemon import the
rest and stay light (``tests/integration/test_imports.py`` checks it).
"""

from rendezvous.errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    LeaseExpiredError,
)

__all__ = [
    "EtcdAuthError",
    "EtcdCompactedError",
    "EtcdError",
    "EtcdNoSpaceError",
    "EtcdUnavailableError",
    "LeaseExpiredError",
]
