"""Everything in tidal that talks to etcd.

``rendezvous.etcd`` (the client factory and facade), ``rendezvous.keys`` (the
key layout), ``rendezvous.etcd.server`` (an embedded etcd), the node registry,
leases, watches and leader election are importable without torch: the
coordinator and the agent daemon use them and must stay light. So are the
contracts both sides of a job share: ``records``, ``worker_env``,
``progress_file``, ``live_files`` and ``assigned_rounds``. Only the torch
rendezvous implementations import torch: ``torch_backend`` (the etcd-v3 backend
for torch.distributed.elastic), ``assigned`` (the agents' rendezvous handler, with
``assigned_join``, its own join record) and ``etcd_store`` (the c10d store in
etcd); ``tests/unit/rendezvous/test_no_torch.py`` checks the rest.
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
