"""The plain values the etcd facade takes and returns.

Keys as etcd holds them, watch events, and the building blocks of a
transaction. They are frozen dataclasses with no grpc or protobuf in them
(:mod:`rendezvous.etcd.messages` converts at the boundary), so test doubles and
callers can build them without a connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int
    version: int = 0


@dataclass(frozen=True)
class WatchBatch:
    """The events of one watch response; ``revision`` is the store's revision."""

    revision: int
    events: tuple[WatchEvent, ...]


# Transaction building blocks: plain data, turned into protobuf at the boundary.
CompareTarget = Literal["version", "create", "mod", "value", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """A transaction guard such as ``Compare(key, "mod", "==", 42)``."""

    key: str
    target: CompareTarget
    op: CompareOp
    value: int | bytes


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


TxnOp = Put | Delete | Get


@dataclass(frozen=True)
class TxnResult:
    """Whether the guards held, and what each ``Get`` of the taken branch saw."""

    succeeded: bool
    revision: int
    gets: tuple[tuple[KeyValue, ...], ...]


def prefix_range_end(prefix: str) -> bytes:
    """The exclusive end of the key range that starts with ``prefix``."""
    end = bytearray(prefix.encode())
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


__all__ = [
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "Get",
    "KeyValue",
    "Put",
    "TxnOp",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
    "prefix_range_end",
]
