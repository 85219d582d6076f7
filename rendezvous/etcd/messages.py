"""The etcd layer's values to and from etcd's protobuf messages.

:mod:`rendezvous.etcd.types` holds plain dataclasses; this module is the one
place that knows etcd's gRPC messages (``etcdrpc``): the requests the facade
sends and the answers it reads back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyetcd import etcdrpc

from rendezvous.etcd.types import (
    Compare,
    Delete,
    KeyValue,
    Put,
    TxnOp,
    TxnResult,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)

_TARGETS = {
    "version": etcdrpc.Compare.VERSION,
    "create": etcdrpc.Compare.CREATE,
    "mod": etcdrpc.Compare.MOD,
    "value": etcdrpc.Compare.VALUE,
    "lease": etcdrpc.Compare.LEASE,
}
_OPS = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}


def key_value(kv: Any) -> KeyValue:
    """A :class:`KeyValue` from etcd's ``mvccpb.KeyValue``."""
    return KeyValue(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


def range_request(
    key: str, *, prefix: bool = False, sorted_by_key: bool = False, count_only: bool = False
) -> Any:
    """A ``RangeRequest`` for ``key``, or every key under it (``prefix``)."""
    request = etcdrpc.RangeRequest(key=key.encode(), count_only=count_only)
    if prefix:
        request.range_end = prefix_range_end(key)
    if sorted_by_key:
        request.sort_order = etcdrpc.RangeRequest.ASCEND
        request.sort_target = etcdrpc.RangeRequest.KEY
    return request


def delete_request(key: str, *, prefix: bool = False) -> Any:
    """A ``DeleteRangeRequest`` for ``key``, or every key under it (``prefix``)."""
    end = prefix_range_end(key) if prefix else b""
    return etcdrpc.DeleteRangeRequest(key=key.encode(), range_end=end)


def compare_message(c: Compare) -> Any:
    """etcd's ``Compare`` for a transaction guard."""
    msg = etcdrpc.Compare(key=c.key.encode(), target=_TARGETS[c.target], result=_OPS[c.op])
    if c.target == "value":
        msg.value = c.value if isinstance(c.value, bytes) else str(c.value).encode()
    elif c.target == "version":
        msg.version = int(c.value)
    elif c.target == "create":
        msg.create_revision = int(c.value)
    elif c.target == "mod":
        msg.mod_revision = int(c.value)
    else:
        msg.lease = int(c.value)
    return msg


def op_message(op: TxnOp) -> Any:
    """etcd's ``RequestOp`` for one operation of a transaction."""
    if isinstance(op, Put):
        return etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease)
        )
    if isinstance(op, Delete):
        return etcdrpc.RequestOp(request_delete_range=delete_request(op.key, prefix=op.prefix))
    return etcdrpc.RequestOp(request_range=range_request(op.key, prefix=op.prefix))


def txn_request(
    compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp]
) -> Any:
    """etcd's ``TxnRequest``: if every guard holds, ``success``, else ``failure``."""
    return etcdrpc.TxnRequest(
        compare=[compare_message(c) for c in compare],
        success=[op_message(op) for op in success],
        failure=[op_message(op) for op in failure],
    )


def txn_result(resp: Any) -> TxnResult:
    """A :class:`TxnResult` from etcd's ``TxnResponse``."""
    gets = tuple(
        tuple(key_value(kv) for kv in r.response_range.kvs)
        for r in resp.responses
        if r.WhichOneof("response") == "response_range"
    )
    return TxnResult(bool(resp.succeeded), int(resp.header.revision), gets)


def watch_batch(resp: Any) -> WatchBatch:
    """A :class:`WatchBatch` from etcd's ``WatchResponse``."""
    return WatchBatch(
        revision=int(resp.header.revision),
        events=tuple(
            WatchEvent(
                kind="delete" if ev.type == ev.DELETE else "put",
                key=ev.kv.key.decode(),
                value=bytes(ev.kv.value),
                mod_revision=ev.kv.mod_revision,
                create_revision=ev.kv.create_revision,
                lease=ev.kv.lease,
                version=ev.kv.version,
            )
            for ev in resp.events
        ),
    )


__all__ = [
    "compare_message",
    "delete_request",
    "key_value",
    "op_message",
    "range_request",
    "txn_request",
    "txn_result",
    "watch_batch",
]
