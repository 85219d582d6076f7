"""Everything in tidal that talks to etcd.

``rendezvous.client`` (the client factory and facade), ``rendezvous.keys`` (the
key layout), ``rendezvous.etcd_server`` (an embedded etcd), the node registry,
leases, watches and leader election are importable without torch: the
coordinator uses them and must stay light. Only ``rendezvous.torch_backend``
(the etcd-v3 backend for torch.distributed.elastic) imports torch.
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
