"""tidal's etcd layer, one module per seam.

* :mod:`rendezvous.etcd.types`: the plain values calls take and return (``KeyValue``,
  ``Compare``, ``Put``, ``Delete``, ``Get``, ``TxnResult``, watch events); no grpc.
* :mod:`rendezvous.etcd.config`: ``EtcdConfig``, how to reach etcd.
* :mod:`rendezvous.etcd.endpoints`: ``EndpointPicker``, which member the next call goes to.
* :mod:`rendezvous.etcd.translate`: gRPC errors into :mod:`rendezvous.errors`, in one place.
* :mod:`rendezvous.etcd.messages`: the values to and from etcd's protobuf messages.
* :mod:`rendezvous.etcd.transport`: the gRPC channels (a pyetcd subclass) and one call on them.
* :mod:`rendezvous.etcd.facade`: ``EtcdClient`` and ``create_client``: every call
  goes through one path that applies a deadline, translates errors and retries
  what is safe to retry.
* :mod:`rendezvous.etcd.stream`: ``WatchStream``, one watch as a plain iterator.
* :mod:`rendezvous.etcd.keepalive`: ``KeepAliveStream``, etcd's LeaseKeepAlive
  stream, which carries the keep-alives of every lease of a process.

This package re-exports the public names, so that callers keep one import:
``from rendezvous.etcd import EtcdClient, create_client, Put, ...``; nothing
outside it imports pyetcd or grpc.
"""

from __future__ import annotations

#: The etcd layer's logger. It keeps the name it had when the layer was one
#: module, so that log lines (and filters on them) read as before.
LOGGER_NAME = "rendezvous.etcd"

# The submodules import LOGGER_NAME from here, so the re-exports come after it.
from rendezvous.etcd.config import EtcdConfig, parse_endpoint  # noqa: E402
from rendezvous.etcd.endpoints import (  # noqa: E402
    MAX_QUARANTINE_S,
    REFUSED_QUARANTINE_S,
    SILENT_QUARANTINE_S,
    EndpointPicker,
)
from rendezvous.etcd.facade import (  # noqa: E402
    STARTUP_WAIT_S,
    EtcdClient,
    create_client,
    create_client_waiting,
)
from rendezvous.etcd.keepalive import KeepAliveStream  # noqa: E402
from rendezvous.etcd.stream import WatchStream  # noqa: E402
from rendezvous.etcd.types import (  # noqa: E402
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    Get,
    KeyValue,
    Put,
    TxnOp,
    TxnResult,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)

__all__ = [
    "MAX_QUARANTINE_S",
    "REFUSED_QUARANTINE_S",
    "SILENT_QUARANTINE_S",
    "STARTUP_WAIT_S",
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "EndpointPicker",
    "EtcdClient",
    "EtcdConfig",
    "Get",
    "KeepAliveStream",
    "KeyValue",
    "Put",
    "TxnOp",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
    "WatchStream",
    "create_client",
    "create_client_waiting",
    "parse_endpoint",
    "prefix_range_end",
]
