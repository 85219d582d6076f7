"""The etcd client tidal uses, by the names the rest of the tree imports.

The etcd layer lives in :mod:`rendezvous.etcd`, one module per seam (value
types, settings, endpoint picking, error translation, protobuf messages, the
gRPC transport, the facade, the watch stream); this module re-exports its
public names so that callers keep one import: ``from rendezvous.client import
EtcdClient, create_client, Put, ...``.
"""

from __future__ import annotations

from rendezvous.etcd.config import EtcdConfig, parse_endpoint
from rendezvous.etcd.endpoints import (
    MAX_QUARANTINE_S,
    REFUSED_QUARANTINE_S,
    SILENT_QUARANTINE_S,
    EndpointPicker,
)
from rendezvous.etcd.facade import EtcdClient, create_client
from rendezvous.etcd.stream import WatchStream
from rendezvous.etcd.types import (
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
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "EndpointPicker",
    "EtcdClient",
    "EtcdConfig",
    "Get",
    "KeyValue",
    "Put",
    "TxnOp",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
    "WatchStream",
    "create_client",
    "parse_endpoint",
    "prefix_range_end",
]
