"""This node's own join record in the assigned rendezvous, and keeping it there.

:class:`rendezvous.elastic.assigned.AssignedRendezvousHandler` owns one
:class:`JoinRecordKeeper`: it puts the node's :class:`JoinRecord` (the round it
wants, its liveness address, its incarnation, whether it is leaving) under the
runner's lease at ``P/rdzv/<job>/assigned/joins/<node>``, puts it back under a
new lease when that lease was lost (etcd unreachable), marks it leaving for a
planned leave, and revokes the lease (deleting the record) when the handler
closes. The handler reads the others' records, probes and writes rounds.

A join record is *fenced* by the node's assignment (``fence``): it is put in
a transaction that holds only while ``assignments/<node>/<job>`` still holds
this runner's generation. A runner cut off from etcd long enough for the
coordinator to drop its node would otherwise put its record back when the
network heals, a moment before its agent stops it; the others would form a
round with it, and wait in that round's store for a member that never
comes. Once the assignment is gone or rewritten, the runner cannot join
again (:class:`AssignmentWithdrawnError`).
"""

from __future__ import annotations

import logging
import threading
import time

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
)

from rendezvous.elastic.assigned_rounds import Fence, JoinRecord, Member
from rendezvous.errors import EtcdError
from rendezvous.etcd import Compare, EtcdClient, Put
from rendezvous.keys import Keys
from rendezvous.lease import LeaseKeeper
from rendezvous.records import Assignment

log = logging.getLogger(__name__)


class AssignmentWithdrawnError(RendezvousClosedError):
    """This node's assignment of the job is gone or holds another generation:
    this runner may not join a round of it again."""


class JoinRecordKeeper:
    """This node's join record: put (fenced, under the runner's lease), kept, withdrawn.

    Args:
        client: the runner's etcd client.
        keys: the key layout.
        run_id / node_id: the job and this node (validated by the handler).
        lease_ttl_s: the TTL of the record's lease.
        join_timeout_s: how long :meth:`put` retries while etcd does not answer.
        fence: the node's assignment; the record is put only while it holds
            this generation (see the module doc). None: no fence.
        stopped: set once the handler closed: no more retries or put-backs.
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        *,
        run_id: str,
        node_id: str,
        lease_ttl_s: int,
        join_timeout_s: float,
        fence: Fence | None,
        stopped: threading.Event,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._node = node_id
        self._key = keys.assigned_join(run_id, node_id)
        self._lease_ttl_s = lease_ttl_s
        self._join_timeout_s = join_timeout_s
        self._fence = fence
        self._stopped = stopped
        self._lock = threading.Lock()
        self._wanted = 0  # the round this node's record asks for
        self._leaving = False  # announce_leaving() was called: every put says so
        self._member: Member | None = None  # set by start()
        self._lease: LeaseKeeper | None = None
        self._rejoin = threading.Event()  # the lease was lost: put the record back
        self._thread: threading.Thread | None = None

    def start(self, member: Member) -> None:
        """Know this node as ``member`` and start putting the record back when its lease is lost."""
        self._member = member
        self._thread = threading.Thread(target=self._keep, name=f"rdzv-record {self._node}",
                                        daemon=True)
        self._thread.start()

    @property
    def wanted(self) -> int:
        """The round this node's record asks for; 0 before the first put."""
        with self._lock:
            return self._wanted

    @property
    def lease_id(self) -> int | None:
        """The lease the record is under while it is held; None otherwise."""
        lease = self._lease
        return lease.lease_id if lease is not None and lease.alive else None

    def put(self, target: int) -> None:
        """Put this node's join record, asking for round ``target``.

        Retries while etcd does not answer, for at most ``join_timeout_s``
        (then RendezvousConnectionError); raises AssignmentWithdrawnError
        once the fence no longer holds.
        """
        assert self._member is not None
        with self._lock:
            self._wanted = target
            record = JoinRecord(self._member, target, leaving=self._leaving)
        deadline = time.monotonic() + self._join_timeout_s
        delay = 0.1
        while True:
            try:
                lease = self._join_lease()
                guard = self._fence_guard()
                put = Put(self._key, record.to_json(), lease)
                if self._client.txn(guard, [put]).succeeded:
                    return
                continue  # the assignment changed between the read and the put: read again
            except EtcdError as exc:
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(
                        f"job {self._run_id}: cannot join the rendezvous: {exc}"
                    ) from exc
                log.warning("cannot put the join record (%s); retrying in %.1f s", exc, delay)
                self._stopped.wait(delay)
                delay = min(2 * delay, 2.0)

    def announce_leaving(self) -> bool:
        """Put the record again, same round and incarnation, with ``leaving`` set.

        Not fenced by the assignment (which a planned leave has usually
        removed already): it holds only while the record is still there under
        this runner's lease. Every later put says leaving too. Returns whether
        the record says leaving now.
        """
        with self._lock:
            wanted = self._wanted
            self._leaving = True
        if self._stopped.is_set() or self._member is None or self._lease is None:
            return False
        lease = self._lease.lease_id
        record = JoinRecord(self._member, wanted, leaving=True)
        try:
            result = self._client.txn([Compare(self._key, "lease", "==", lease)],
                                      [Put(self._key, record.to_json(), lease)])
        except EtcdError as exc:
            log.warning("cannot announce that node %s leaves: %s", self._node, exc)
            return False
        if result.succeeded:
            log.info("node %s announced that it leaves job %s", self._node, self._run_id)
        return result.succeeded

    def close(self) -> None:
        """Stop putting the record back and revoke its lease (deleting it at once).
        Call once ``stopped`` is set; :meth:`join` waits for the thread."""
        self._rejoin.set()
        if self._lease is not None:
            self._lease.close(revoke=True)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _fence_guard(self) -> list[Compare]:
        """The transaction guard of a join: this node's assignment, as it is now,
        holds this runner's generation. Raises AssignmentWithdrawnError if not."""
        fence = self._fence
        if fence is None:
            return []
        kv = self._client.get(fence.key)
        generation = None
        if kv is not None:
            try:
                generation = Assignment.model_validate_json(kv.value).generation
            except ValueError:
                generation = None
        if generation != fence.generation:
            raise AssignmentWithdrawnError(
                f"job {self._run_id}: the assignment of node {self._node} at generation "
                f"{fence.generation} is {'gone' if kv is None else 'replaced'}: not joining"
            )
        return [Compare(fence.key, "mod", "==", kv.mod_revision)]  # type: ignore[union-attr]

    def _join_lease(self) -> int:
        if self._lease is None or not self._lease.alive:
            if self._lease is not None:
                self._lease.close(revoke=False)
            self._lease = LeaseKeeper(
                self._client, ttl_s=self._lease_ttl_s, on_lost=self._rejoin.set,
                name=f"rendezvous {self._run_id}/{self._node}",
            ).start()
        return self._lease.lease_id

    def _keep(self) -> None:
        """Put the join record back when its lease was lost (etcd unreachable)."""
        while not self._stopped.is_set():
            self._rejoin.wait()
            if self._stopped.is_set():
                return
            self._rejoin.clear()
            with self._lock:
                wanted = self._wanted
            log.warning("the rendezvous lease was lost: putting the join record back")
            try:
                self.put(wanted)
            except AssignmentWithdrawnError as exc:
                log.warning("%s", exc)
                return  # the agent stops this runner; the others go on without it
            except RendezvousConnectionError as exc:
                log.error("%s", exc)
