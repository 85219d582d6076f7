"""The node registry: which nodes are alive, as records in etcd held by leases.

A node agent registers its node with :meth:`NodeRegistry.register`: a JSON
:class:`NodeInfo` record at ``keys.node(node_id)``, attached to a lease that a
:class:`~rendezvous.lease.LeaseKeeper` keeps alive. A node whose agent dies
stops refreshing its lease, and etcd deletes the record within the lease's
TTL: a node is alive exactly as long as its key exists.

Registration is put-if-absent: a node id already held by another live lease is
refused with :class:`NodeAlreadyRegisteredError`, so two agents can never claim
the same node. When the registration's own lease is lost (etcd unreachable for
longer than the TTL, or restarted), :class:`NodeRegistration` registers the
same record again under a new lease, retrying with a backoff until it succeeds
or is closed. A restarted etcd restores the old lease with a full TTL, so the
old record may still be there: re-registration takes over a key that is still
held by its *own previous* lease (compared in the same transaction), and then
revokes that lease.

The coordinator follows the nodes with :meth:`NodeRegistry.watch_nodes`, built
on :class:`~rendezvous.watch.PrefixWatcher`.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from types import TracebackType

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rendezvous.errors import EtcdError
from rendezvous.etcd import Compare, EtcdClient, Get, Put, WatchEvent
from rendezvous.gpus import MAX_GPUS, GpuInfo, check_indices
from rendezvous.keys import Keys, validate_id
from rendezvous.lease import LeaseKeeper
from rendezvous.node_logs import log_proof
from rendezvous.watch import PrefixWatcher

log = logging.getLogger(__name__)

MAX_LABELS = 32
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$")
_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9._:/=+-]{0,128}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9.:_\[\]-]{1,253}$")


def _tidal_version() -> str:
    try:
        return metadata.version("tidal")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class NodeAlreadyRegisteredError(EtcdError):
    """Another live process holds the node id this process tried to register."""


class LogEndpoint(BaseModel):
    """Where the coordinator reads a node's job logs (agent.node.logserve) and the
    bearer token that route wants. The token is made at random by the agent
    and is read only by etcd's clients; it never appears in the API."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(pattern=r"^http://[A-Za-z0-9.:_\[\]-]{1,253}:[0-9]{1,5}$")
    token: str = Field(min_length=16, max_length=256, repr=False)

    def proof(self, nonce: str) -> str:
        """What the agent answers to the coordinator's ``nonce`` (``X-Tidal-Proof``):
        the server proves it holds the token too, so the coordinator reads logs only
        from the node's own agent, not from whatever took over its address."""
        return log_proof(self.token, nonce)




class NodeInfo(BaseModel):
    """What the registry records about a live node (JSON in etcd, never pickle).

    Attributes:
        node_id: the node's name in keys and the API (see ``keys.validate_id``).
        host: the machine's host name.
        address: where other nodes reach it (IP address or resolvable name).
        slots: how many workers it can run (on a GPU node: its healthy GPUs,
            so 0 once they all failed).
        gpus: how many GPUs it has (>= 0), healthy or not: ``len(gpu_devices)``
            when those are given.
        gpu_devices: each GPU, with its locality and health
            (:class:`rendezvous.gpus.GpuInfo`); empty on a CPU node.
        labels: free-form ``key -> value`` tags for scheduling (bounded).
        started_at: when the agent started (UTC).
        version: the tidal version the agent runs.
        logs: where its agent serves the jobs' logs, if it does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_id: str
    host: str = Field(default_factory=socket.gethostname)
    address: str = "127.0.0.1"
    slots: int = Field(default=1, ge=0, le=4096)
    gpus: int = Field(default=0, ge=0, le=MAX_GPUS)
    gpu_devices: list[GpuInfo] = Field(default_factory=list, max_length=MAX_GPUS)
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    version: str = Field(default_factory=_tidal_version, max_length=64)
    logs: LogEndpoint | None = None

    @field_validator("node_id")
    @classmethod
    def _check_node_id(cls, value: str) -> str:
        return validate_id(value, what="node id")

    @field_validator("host", "address")
    @classmethod
    def _check_host(cls, value: str) -> str:
        if not _HOST_RE.match(value):
            raise ValueError(
                f"{value!r} is not a host name or address (1-253 characters from "
                "[A-Za-z0-9.:_-] and brackets)"
            )
        return value

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_LABELS:
            raise ValueError(f"a node has at most {MAX_LABELS} labels, not {len(value)}")
        for key, text in value.items():
            if not _LABEL_KEY_RE.match(key):
                raise ValueError(
                    f"label key {key!r} is not valid: 1-63 characters from [A-Za-z0-9._/-], "
                    "starting with a letter or digit"
                )
            if not _LABEL_VALUE_RE.match(text):
                raise ValueError(
                    f"label {key!r} has value {text!r}: use at most 128 characters "
                    "from [A-Za-z0-9._:/=+-]"
                )
        return value

    @field_validator("gpu_devices")
    @classmethod
    def _check_gpus(cls, value: list[GpuInfo]) -> list[GpuInfo]:
        check_indices(value)
        return value

    @model_validator(mode="after")
    def _gpu_count(self) -> NodeInfo:
        if self.gpu_devices and self.gpus != len(self.gpu_devices):
            raise ValueError(
                f"gpus ({self.gpus}) must be the number of gpu_devices ({len(self.gpu_devices)})"
            )
        return self

    @property
    def healthy_gpus(self) -> int:
        """The GPUs the node offers: those not failed (all ``gpus`` without a device list)."""
        if not self.gpu_devices:
            return self.gpus
        return sum(1 for gpu in self.gpu_devices if gpu.healthy)

    def to_json(self) -> bytes:
        """The record as stored in etcd."""
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeInfo:
        """Parse a stored record.

        Raises:
            pydantic.ValidationError: the record is not a valid node record.
        """
        return cls.model_validate_json(data)


class NodeRegistration:
    """One node's registration: its record, its lease, and the re-registering.

    Built and started by :meth:`NodeRegistry.register`; end it with
    :meth:`deregister` (or use it as a context manager).

    Args:
        client: the process's etcd client.
        info: the node's record.
        ttl_s: the lease's TTL: how long after its agent dies a node is gone.
        retry_max_s: the longest wait between re-registration attempts.
    """

    def __init__(
        self,
        client: EtcdClient,
        info: NodeInfo,
        *,
        ttl_s: int,
        retry_max_s: float = 2.0,
    ) -> None:
        self._client = client
        self.info = info
        self.key = client.keys.node(info.node_id)
        self.ttl_s = ttl_s
        self._retry_max = retry_max_s
        self._keeper: LeaseKeeper | None = None
        self._previous_lease = 0
        self._lost = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.registrations = 0  # how many times the record was (re)written

    # public API ---------------------------------------------------------------

    def start(self) -> NodeRegistration:
        """Register the node now and start re-registering it whenever its lease is lost.

        Raises:
            NodeAlreadyRegisteredError: another live lease holds this node id.
            EtcdError: etcd could not be reached within the client's timeout.
        """
        self._register_once()
        self._thread = threading.Thread(
            target=self._supervise, name=f"registration {self.info.node_id}", daemon=True
        )
        self._thread.start()
        return self

    @property
    def lease_id(self) -> int:
        """The lease currently holding the record (0 while re-registering)."""
        keeper = self._keeper
        return keeper.lease_id if keeper is not None and keeper.alive else 0

    @property
    def registered(self) -> bool:
        """True while the record is held by a live lease, as far as this process knows."""
        keeper = self._keeper
        return keeper is not None and keeper.alive and not self._closed.is_set()

    def update(self, info: NodeInfo) -> bool:
        """Publish a changed record (a GPU failed) under the registration's lease.

        The record is written only while the key is held by this registration's
        current lease; without it, the re-registration writes ``info`` anyway.

        Args:
            info: the new record; its ``node_id`` must be this registration's.

        Returns:
            True if it was written now, False if it waits for the re-registration.

        Raises:
            ValueError: ``info`` is another node's.
            EtcdError: etcd could not be reached; ``info`` is kept for the next write.
        """
        if info.node_id != self.info.node_id:
            raise ValueError(f"the record of {info.node_id} cannot replace {self.info.node_id}'s")
        self.info = info
        lease = self.lease_id
        if not lease:
            return False
        put = Put(self.key, info.to_json(), lease=lease)
        return self._client.txn([Compare(self.key, "lease", "==", lease)], [put]).succeeded

    def deregister(self) -> None:
        """Remove the node now: revoke the lease, which deletes the record."""
        self.close(revoke=True)

    def close(self, *, revoke: bool = True) -> None:
        """Stop keeping the registration alive.

        Args:
            revoke: False leaves the record to expire within its TTL, as a
                crashed agent's would.
        """
        self._closed.set()
        self._lost.set()  # wake the supervisor so that it sees the close
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._client.config.timeout_s + 1)
        keeper = self._keeper
        if keeper is not None:
            keeper.close(revoke=revoke)

    def __enter__(self) -> NodeRegistration:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.deregister()

    # registering ----------------------------------------------------------------

    def _register_once(self) -> None:
        """Grant a lease and write the record if the key is free or ours.

        Raises:
            NodeAlreadyRegisteredError: another lease holds the key.
            EtcdError: etcd failed; the new lease is revoked (best effort).
        """
        self._lost.clear()
        keeper = LeaseKeeper(
            self._client,
            ttl_s=self.ttl_s,
            on_lost=self._lost.set,
            name=f"node {self.info.node_id}",
        ).start()
        try:
            self._put_if_free(keeper.lease_id)
        except BaseException:
            keeper.close(revoke=True)
            raise
        old, self._previous_lease = self._previous_lease, keeper.lease_id
        self._keeper = keeper
        self.registrations += 1
        if old:
            # A restarted etcd restores the old lease with a full TTL; it holds
            # nothing now, but must not linger. Best effort: it expires anyway.
            try:
                self._client.revoke_lease(old)
            except EtcdError as exc:
                log.info("node %s: could not revoke old lease %x (%s)", self.info.node_id, old, exc)
        log.info(
            "node %s registered under lease %x (ttl %d s)",
            self.info.node_id,
            keeper.lease_id,
            self.ttl_s,
        )

    def _put_if_free(self, lease_id: int) -> None:
        put = Put(self.key, self.info.to_json(), lease=lease_id)
        free = self._client.txn([Compare(self.key, "create", "==", 0)], [put], [Get(self.key)])
        if free.succeeded:
            return
        holder = free.gets[0][0].lease if free.gets and free.gets[0] else 0
        if self._previous_lease and holder == self._previous_lease:
            ours = self._client.txn([Compare(self.key, "lease", "==", holder)], [put])
            if ours.succeeded:
                return
        raise NodeAlreadyRegisteredError(
            f"node id {self.info.node_id!r} is already registered by another live agent "
            f"(lease {holder:x}); stop that agent, wait for its lease to expire "
            f"(at most its TTL) or choose another node id"
        )

    def _supervise(self) -> None:
        # close() sets _closed before _lost, and _register_once clears _lost
        # before this loop looks at _closed, so a close is never missed.
        while not self._closed.is_set():
            self._lost.wait()
            if self._closed.is_set():
                return
            log.warning("node %s: its lease was lost; registering again", self.info.node_id)
            delay = 0.1
            while not self._closed.is_set():
                try:
                    self._register_once()
                    break
                except NodeAlreadyRegisteredError:
                    log.exception("node %s: cannot register again", self.info.node_id)
                except EtcdError as exc:
                    log.info("node %s: re-registration failed (%s)", self.info.node_id, exc)
                self._closed.wait(delay)
                delay = min(delay * 2, self._retry_max)


NodeCallback = Callable[[NodeInfo], None]
LeaveCallback = Callable[[str], None]


class NodeRegistry:
    """Register nodes, list the live ones, follow them as they come and go.

    Args:
        client: the process's etcd client (its key root decides the namespace).
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._prefix = client.keys.nodes_prefix()

    def register(self, info: NodeInfo, *, ttl_s: int = 10) -> NodeRegistration:
        """Register a node under a new lease, kept alive until deregistered.

        Args:
            info: the node's record.
            ttl_s: how long after its agent stops a node disappears (>= 2).

        Returns:
            The started :class:`NodeRegistration`.

        Raises:
            NodeAlreadyRegisteredError: another live agent holds ``info.node_id``.
            EtcdError: etcd could not be reached within the client's timeout.
        """
        return NodeRegistration(self._client, info, ttl_s=ttl_s).start()

    def get(self, node_id: str) -> NodeInfo | None:
        """The live record of ``node_id``, or None if the node is not registered."""
        kv = self._client.get(self._client.keys.node(node_id))
        return self._parse(kv.key, kv.value) if kv is not None else None

    def list_nodes(self) -> list[NodeInfo]:
        """Every live node, ordered by node id (records that fail to parse are skipped)."""
        kvs, _ = self._client.get_prefix(self._prefix)
        parsed = (self._parse(kv.key, kv.value) for kv in kvs)
        return [info for info in parsed if info is not None]

    def watch_nodes(
        self,
        on_join: NodeCallback,
        on_leave: LeaveCallback,
        *,
        on_update: NodeCallback | None = None,
    ) -> PrefixWatcher:
        """Follow the live nodes: ``on_join`` for each node already there and each new one.

        Args:
            on_join: called with a node's record when it appears.
            on_leave: called with a node's id when it disappears.
            on_update: called when a live node's record changes (optional).

        Returns:
            The started :class:`PrefixWatcher`; stop it with ``stop()``.
        """
        live: set[str] = set()

        def on_event(event: WatchEvent) -> None:
            node_id = Keys.id_under(self._prefix, event.key)
            if node_id is None:
                return  # not a node record
            if event.kind == "delete":
                if node_id in live:
                    live.discard(node_id)
                    on_leave(node_id)
                return
            info = self._parse(event.key, event.value)
            if info is None:
                return
            if node_id not in live:
                live.add(node_id)
                on_join(info)
            elif on_update is not None:
                on_update(info)

        return PrefixWatcher(
            self._client, self._prefix, on_event=on_event, name="watch nodes"
        ).start()

    @staticmethod
    def _parse(key: str, value: bytes) -> NodeInfo | None:
        try:
            return NodeInfo.from_json(value)
        except ValidationError as exc:
            log.warning("ignoring the invalid node record at %s: %s", key, exc)
            return None
