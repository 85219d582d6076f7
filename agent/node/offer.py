"""What the node offers the coordinator, and the jobs that lose it: a GPU that fails,
GPUs that are not free.

The node record (:class:`rendezvous.registry.NodeInfo`: host, address,
labels, slots and GPUs, where its logs are served) is registered under the
agent's lease; an agent restarted after a crash waits out the lease of the one
it replaces. :class:`agent.node.gpus.NodeGpus` knows the node's GPUs; this
module is what the daemon (:class:`agent.node.daemon.Agent`) does about them,
each pass:

* GPU records that changed (one failed) are published in the node record,
  so the coordinator offers only the healthy ones.
* A runner holding a GPU that failed is killed at once, without grace (the
  GPU is gone), once; when its exit is settled the job *leaves* this node.
* A job whose GPUs are not free waits while a stopping runner holds GPUs
  (they come free when it exits); with none stopping it leaves at once.

Leaving writes the job's status on this node CANCELLED, with why in its
error: the coordinator takes the node out of the job, as for a node that
died. The decisions are pure functions (:func:`evictions`,
:func:`waits_for_devices`, :func:`left_status`); :class:`NodeOffer` keeps
the node record and carries the decisions out, with their bookkeeping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Protocol

from pydantic import ValidationError

from agent.node.gpus import NodeGpus
from agent.node.settings import AgentSettings
from rendezvous.errors import EtcdUnavailableError
from rendezvous.etcd import STARTUP_WAIT_S, EtcdClient
from rendezvous.records import (
    RUNNER_RANK,
    Assignment,
    JobNodeState,
    JobNodeStatus,
    WorkerError,
    utcnow,
)
from rendezvous.registry import (
    LogEndpoint,
    NodeAlreadyRegisteredError,
    NodeInfo,
    NodeRegistration,
    NodeRegistry,
)

log = logging.getLogger(__name__)


class Killable(Protocol):
    def kill(self) -> None: ...


class HeldRunner(Protocol):
    """What this module needs of a live runner (the daemon's)."""

    assignment: Assignment
    stop_deadline: float | None  # set once it is being stopped
    devices: list[int] | None  # its GPUs; None on a CPU node

    @property
    def process(self) -> Killable: ...  # a subprocess.Popen


def held_devices(runners: Mapping[str, HeldRunner]) -> dict[str, list[int]]:
    """The devices each live runner holds (one being stopped too, until it exits)."""
    return {job_id: r.devices for job_id, r in runners.items() if r.devices}


def evictions(
    failed: Mapping[str, str], generations: Mapping[str, int], evicted: Collection[str]
) -> dict[str, tuple[int, str]]:
    """The runners a failed GPU takes off the node now.

    Args:
        failed: job -> why, for the jobs holding a failed GPU
            (:meth:`agent.node.gpus.NodeGpus.failed_holders`).
        generations: job -> the generation its live runner runs.
        evicted: jobs already taken off (each is evicted once).

    Returns:
        job -> (its runner's generation, why), for the jobs not evicted yet.
    """
    return {job_id: (generations[job_id], why)
            for job_id, why in failed.items() if job_id not in evicted}


def waits_for_devices(runners: Iterable[HeldRunner]) -> bool:
    """Whether a job whose GPUs are not free waits (rather than leaves): only while a
    runner being stopped holds GPUs, which come free when it exits."""
    return any(r.stop_deadline is not None and r.devices for r in runners)


def left_status(
    assignment: Assignment, node_id: str, reason: str, reported: JobNodeStatus | None,
    now: datetime,
) -> JobNodeStatus:
    """The status that leaves ``assignment``'s job on this node: CANCELLED, ``reason``
    in its error; what ``reported`` said of the same generation is kept."""
    status = reported
    if status is None or status.generation != assignment.generation:
        status = JobNodeStatus(job_id=assignment.job_id, node_id=node_id,
                               generation=assignment.generation, state=JobNodeState.STARTING)
    return status.model_copy(update={
        "state": JobNodeState.CANCELLED, "updated_at": now,
        "error": WorkerError(rank=RUNNER_RANK, exit_code=0, message=reason[:4096]),
    })


class NodeOffer:
    """The node's record and the daemon's acts on its GPUs' faults, with what it
    remembers of them; main thread only.

    Args:
        settings: the agent's settings.
        gpus: the node's GPUs.
    """

    def __init__(self, settings: AgentSettings, gpus: NodeGpus) -> None:
        self._settings = settings
        self._gpus = gpus
        self._node_id = settings.node_id
        self.logs: LogEndpoint | None = None  # where the jobs' logs are served, once they are
        self.registration: NodeRegistration | None = None
        # job -> (generation, why): runners killed because a GPU they held failed
        self._evicted: dict[str, tuple[int, str]] = {}
        self._waiting: dict[str, int] = {}  # job -> generation waiting for devices (logged)

    def info(self) -> NodeInfo:
        """The node record now."""
        s = self._settings
        return NodeInfo(
            node_id=s.node_id,
            host=os.uname().nodename,
            address=s.address,
            labels=s.labels,
            **self._gpus.record_fields(),
            logs=self.logs,
        )

    def register(self, client: EtcdClient, stop: threading.Event) -> NodeRegistration:
        """Register the node; after a crash, wait out the previous incarnation's lease.

        A restarted agent finds its node id still held by the lease of the
        process it replaces until that lease expires (at most one TTL), or
        until ``stop`` is set. While etcd does not answer, it tries again for
        up to :data:`~rendezvous.etcd.STARTUP_WAIT_S` (a try whose write was
        applied although its answer never came holds the id under a lease
        nobody keeps alive: the wait for an earlier lease covers it).
        """
        registry = NodeRegistry(client)
        ttl_s = self._settings.lease_ttl_s
        held_until: float | None = None  # from the first time the id was found held
        unavailable_until = time.monotonic() + STARTUP_WAIT_S
        while True:
            try:
                self.registration = registry.register(self.info(), ttl_s=ttl_s)
                self._gpus.confirm()
                return self.registration
            except NodeAlreadyRegisteredError:
                if held_until is None:
                    held_until = time.monotonic() + ttl_s + 2
                if time.monotonic() > held_until or stop.is_set():
                    raise
                log.info("node id %s is held by an earlier lease; waiting", self._node_id)
                stop.wait(0.5)
            except EtcdUnavailableError as exc:
                if time.monotonic() > unavailable_until or stop.is_set():
                    raise
                log.warning("registering node %s: %s; trying again", self._node_id, exc)
                stop.wait(1.0)

    def follow(self, runners: Mapping[str, HeldRunner]) -> None:
        """Publish changed GPU records; take a job off a GPU that failed, as if the node died.

        Raises:
            rendezvous.errors.EtcdError: not published; the next pass tries again.
        """
        self.publish()
        self.evict(runners)

    def publish(self) -> None:
        """Publish the GPU records in the node record if they changed.

        Raises:
            rendezvous.errors.EtcdError: not published; the next pass tries again.
        """
        if not self._gpus.changed() or self.registration is None:
            return
        info = self.info()
        self.registration.update(info)
        self._gpus.confirm()
        for gpu in info.gpu_devices:
            if not gpu.healthy:
                log.error("GPU %d (%s) is out of this node's offer: %s",
                          gpu.index, gpu.uuid or "no uuid", gpu.fault)

    def evict(self, runners: Mapping[str, HeldRunner]) -> None:
        """Kill, without grace, the runners that hold a GPU that failed (:func:`evictions`)."""
        failed = self._gpus.failed_holders(held_devices(runners))
        generations = {job_id: r.assignment.generation for job_id, r in runners.items()}
        for job_id, (generation, reason) in evictions(failed, generations, self._evicted).items():
            log.error("job %s loses this node: %s", job_id, reason)
            self._evicted[job_id] = (generation, reason)
            runner = runners[job_id]
            runner.stop_deadline = time.monotonic()  # no grace: the GPU is gone
            with contextlib.suppress(ProcessLookupError):
                runner.process.kill()

    def eviction(self, assignment: Assignment) -> str | None:
        """Why ``assignment``'s runner was evicted, if it was: its job leaves."""
        evicted = self._evicted.get(assignment.job_id)
        return evicted[1] if evicted is not None and evicted[0] == assignment.generation else None

    def waits(self, assignment: Assignment, reason: str, runners: Iterable[HeldRunner]) -> bool:
        """Whether ``assignment``, whose GPUs are not free (``reason``), waits for a
        stopping runner's (:func:`waits_for_devices`); if not, the daemon leaves it."""
        if not waits_for_devices(runners):
            self._waiting.pop(assignment.job_id, None)
            return False
        if self._waiting.get(assignment.job_id) != assignment.generation:
            self._waiting[assignment.job_id] = assignment.generation
            log.info("job %s waits for a stopping job's GPUs: %s", assignment.job_id, reason)
        return True

    def placed(self, job_id: str) -> None:
        """``job_id`` got its devices: it waits no more."""
        self._waiting.pop(job_id, None)

    def leave(self, client: EtcdClient, assignment: Assignment, reason: str) -> None:
        """Write the status that leaves the job on this node (:func:`left_status`).

        Raises:
            rendezvous.errors.EtcdError: not written; the caller tries again.
        """
        key = client.keys.status(assignment.job_id, self._node_id)
        kv = client.get(key)
        reported = None
        if kv is not None:
            with contextlib.suppress(ValidationError):
                reported = JobNodeStatus.model_validate_json(kv.value)
        status = left_status(assignment, self._node_id, reason, reported, utcnow())
        client.put(key, status.model_dump_json().encode())
        if self.eviction(assignment) is not None:
            del self._evicted[assignment.job_id]
        log.warning("job %s left on this node: %s", assignment.job_id, reason)
