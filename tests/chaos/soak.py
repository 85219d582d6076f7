"""The chaos soak's fault injection: one fault at a time, then its recovery and its trace.

:class:`Soak` injects a fault of a given kind into a :class:`~tests.chaos.cluster.ChaosCluster`
while the job trains, restarts what an operator's supervisor would restart,
waits (with deadlines) until the job has made a step past the one it was at,
and checks that the fault left its mark: the job events it must produce
(:data:`~tests.chaos.plan.EVENT_OF`; a killed worker or runner also in its
node's restart count), or for faults that produce none, the new leader and no
node falsely declared lost.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from typing import Any

from rendezvous.records import JobNodeStatus
from tests.chaos.cluster import (
    COORDINATORS,
    ELECTION_TTL_S,
    LEASE_TTL_S,
    NODES,
    ChaosCluster,
    process_table,
)
from tests.chaos.plan import FaultKind
from tests.chaos.report import Fault, Tally
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
RECOVERY_TIMEOUT_S = 120.0  # a fault's recovery on a loaded 2-core machine
EVENT_TIMEOUT_S = 45.0


class Soak:
    """Inject faults into ``cluster`` while job ``job_id`` trains; record them in ``tally``."""

    def __init__(
        self, cluster: ChaosCluster, job_id: str, rng: random.Random, tally: Tally
    ) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.rng = rng
        self.tally = tally
        self.t0 = time.monotonic()
        self.problems: list[str] = []  # faults that left no trace where they must
        # node, (generation, restarts, charged restarts)
        self._victim: tuple[str, tuple[int, int, int]] = ("", (0, 0, 0))

    # reading the job -------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        return self.cluster.job(self.job_id)

    def events_since(self, seq: int) -> list[dict[str, Any]]:
        return [e for e in self.cluster.events(self.job_id) if e["seq"] >= seq]

    def next_seq(self) -> int:
        return max((e["seq"] for e in self.cluster.events(self.job_id)), default=-1) + 1

    def wait_event(self, reason: str, node: str, seq: int, *, unless_ended: bool = False) -> None:
        """Wait for a job event of ``reason`` naming ``node`` (or, if ``unless_ended``,
        for the job's end: a node cannot rejoin a job that finished meanwhile)."""

        def seen() -> bool:
            if any(e["reason"] == reason and node in e["nodes"] for e in self.events_since(seq)):
                return True
            return unless_ended and self.view()["phase"] in ("SUCCEEDED", "FAILED", "CANCELLED")

        wait_for(seen, timeout=EVENT_TIMEOUT_S, interval=0.2,
                 what=f"a {reason} event naming {node}")

    def wait_progress(self, past: int, *, what: str) -> dict[str, Any]:
        """Wait until the job runs at full size and made a step past ``past`` (or ended).

        Raises:
            AssertionError: the job ended other than SUCCEEDED.
        """

        def progressed() -> dict[str, Any] | None:
            view = self.view()
            if view["phase"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return view
            nodes = view["nodes"]
            # Every node running, each past ``past``: a node's last step restarts
            # from its checkpoint when its workers restart.
            full = (view["phase"] == "RUNNING" and view["world_size"] == len(NODES)
                    and len(nodes) == len(NODES)
                    and all(n["state"] == "running" for n in nodes))
            return view if full and min(n["last_step"] or 0 for n in nodes) > past else None

        view: dict[str, Any] = wait_for(
            progressed, timeout=RECOVERY_TIMEOUT_S, interval=0.2,
            what=f"the job at world size {len(NODES)} past step {past} ({what})")
        assert view["phase"] in ("RUNNING", "SUCCEEDED"), (
            f"the job ended {view['phase']} after {what}: {view.get('error')}"
        )
        return view

    # one fault ---------------------------------------------------------------------------

    def inject(self, kind: FaultKind) -> Fault:
        """Inject one fault of ``kind``, recover from it, and record it in the tally."""
        before = self.view()
        seq = self.next_seq()
        started = time.monotonic()
        fault = Fault(kind=kind, target="", at_s=round(started - self.t0, 1),
                      step=before["last_step"] or 0,
                      checkpoint_step=before["last_checkpoint_step"] or 0)
        self.tally.faults.append(fault)
        handler = {
            FaultKind.KILL_AGENT: self._kill_agent,
            FaultKind.KILL_RUNNER: self._kill_runner,
            FaultKind.KILL_WORKER: self._kill_worker,
            FaultKind.KILL_COORDINATOR: self._kill_coordinator,
            FaultKind.KILL_ETCD: self._kill_etcd,
            FaultKind.STOP: self._stop,
        }[kind]
        expects_node_events = handler(fault, seq)
        if kind in (FaultKind.KILL_WORKER, FaultKind.KILL_RUNNER):
            self._wait_restart_reported(fault, seq)
        after = self.wait_progress(fault.step, what=f"{kind.value} {fault.target}")
        fault.recovery_s = round(time.monotonic() - started, 1)
        fault.job_restarts = dict(after["restarts"])
        events = self.events_since(seq)
        fault.events = [f"{e['reason']}({','.join(e['nodes'])})" for e in events]
        fault.restarted = (
            fault.restarted or after["restart_count"] > before["restart_count"]
            or any(e["reason"] in ("node_lost", "node_joined", "restarted") for e in events)
        )
        if not expects_node_events:
            lost = [e for e in events if e["reason"] == "node_lost"]
            if lost:
                self.problems.append(
                    f"{kind.value} {fault.target} (at {fault.at_s} s) made a node falsely "
                    f"declared lost: {lost}")
        if not fault.accounted:
            fault.accounted = "events " + ", ".join(fault.events)
        log.info("chaos: %s %s at step %d recovered in %.1f s; events %s; %s", kind.value,
                 fault.target, fault.step, fault.recovery_s, fault.events, fault.accounted)
        return fault

    def _wait_restart_reported(self, fault: Fault, seq: int) -> None:
        """A killed worker or runner must show in its node's status: a restart counted,
        or a new generation. A restart charged to the node's budget (``worker_failed``)
        must also show in the job's events: a ``restart_charged`` event naming the node."""
        node, (generation, count, charged) = self._victim
        try:
            def reported() -> JobNodeStatus | None:
                st = self.cluster.node_status(self.job_id, node)
                if st is None or (st.generation, st.restart_count) == (generation, count):
                    return None
                return st

            st: JobNodeStatus = wait_for(reported, timeout=EVENT_TIMEOUT_S, interval=0.1,
                                         what=f"{node}'s status to count a restart")
            fault.accounted = (
                f"{node}'s status: generation {generation} -> {st.generation}, "
                f"restart_count {count} -> {st.restart_count} "
                f"({st.last_restart_reason.value if st.last_restart_reason else '-'})")
            fault.restarted = True
            if (st.generation == generation
                    and st.restart_reasons.get("worker_failed", 0) > charged):
                self.wait_event("restart_charged", node, seq, unless_ended=True)
                fault.accounted += "; a restart_charged event"
        except TimeoutError as exc:
            self.problems.append(f"{fault.kind.value} {fault.target} (at {fault.at_s} s) left "
                                 f"no trace: {exc}")

    def _mark_victim(self, node: str) -> None:
        st = self.cluster.node_status(self.job_id, node)
        self._victim = (node, (st.generation, st.restart_count,
                               st.restart_reasons.get("worker_failed", 0)) if st else (0, 0, 0))

    # the kinds ------------------------------------------------------------------------------

    def _node(self) -> str:
        return self.rng.choice(NODES)

    def _kill_agent(self, fault: Fault, seq: int) -> bool:
        node = self._node()
        fault.target = f"agent {node}"
        below = self.cluster.kill_agent(node)
        wait_for(lambda: not set(below) & set(process_table()), timeout=20, interval=0.1,
                 what=f"{node}'s runner and workers gone after its agent's SIGKILL")
        self.wait_event("node_lost", node, seq)
        self.cluster.start_agent(node)  # the operator's supervisor restarts it
        self.wait_event("node_joined", node, seq, unless_ended=True)
        return True

    def _kill_runner(self, fault: Fault, seq: int) -> bool:
        node = self._node()
        pid: int = wait_for(lambda: self.cluster.runner_of(node), timeout=30, interval=0.1,
                            what=f"{node}'s job runner")
        fault.target = f"runner of {node} (pid {pid})"
        self._mark_victim(node)
        os.kill(pid, signal.SIGKILL)
        return False

    def _kill_worker(self, fault: Fault, seq: int) -> bool:
        node = self._node()
        workers = wait_for(lambda: self.cluster.workers_of(node), timeout=30, interval=0.1,
                           what=f"a worker of {node}")
        pid = self.rng.choice(workers)
        fault.target = f"worker of {node} (pid {pid})"
        self._mark_victim(node)
        os.kill(pid, signal.SIGKILL)
        return False

    def _kill_coordinator(self, fault: Fault, seq: int) -> bool:
        name = self.rng.choice(COORDINATORS)
        leader = self.cluster.leader()
        fault.target = f"coordinator {name} ({'leader' if name == leader else 'standby'})"
        self.cluster.kill_coordinator(name)
        other = next(c for c in COORDINATORS if c != name)
        wait_for(lambda: self.cluster.leader() == other, timeout=30, interval=0.2,
                 what=f"coordinator {other} leading after {name}'s SIGKILL")
        self.cluster.restart_coordinator(name)  # the operator's supervisor restarts it
        self.cluster.wait_coordinators()
        fault.accounted = f"{other} led; {name} restarted"
        return False

    def _kill_etcd(self, fault: Fault, seq: int) -> bool:
        name = self.rng.choice(sorted(self.cluster.etcd.members))
        leader = self.cluster.etcd.leader()
        fault.target = f"etcd {name} ({'leader' if name == leader else 'follower'})"
        down = self.rng.uniform(0.5, 3.0)
        back_at = time.monotonic() + down
        self.cluster.kill_etcd(name)
        wait_for(lambda: self.cluster.etcd.leader() not in (None, name), timeout=30,
                 interval=0.2, what=f"an etcd leader other than {name}")
        time.sleep(max(0.0, back_at - time.monotonic()))  # the fault lasts this long
        self.cluster.etcd.restart(name)
        fault.accounted = f"{name} down {down:.1f} s, restarted; no node_lost expected"
        return False

    def _stop(self, fault: Fault, seq: int) -> bool:
        target = self.rng.choice(("agent", "coordinator", "etcd"))
        if target == "agent":
            node = self._node()
            fault.target = f"SIGSTOP agent {node}'s process group"
            self.cluster.signal_agent_group(node, signal.SIGSTOP)
            try:  # stopped past its lease: the coordinator must see the node lost
                self.wait_event("node_lost", node, seq)
            finally:
                self.cluster.signal_agent_group(node, signal.SIGCONT)
            # It fenced itself and came back.
            self.wait_event("node_joined", node, seq, unless_ended=True)
            return True
        if target == "coordinator":
            name = self.cluster.leader() or self.rng.choice(COORDINATORS)
            other = next(c for c in COORDINATORS if c != name)
            fault.target = f"SIGSTOP coordinator {name} (leader)"
            self.cluster.signal_coordinator(name, signal.SIGSTOP)
            try:  # stopped past its election lease: the standby takes over
                wait_for(lambda: self.cluster.leader() == other, timeout=ELECTION_TTL_S + 30,
                         interval=0.2, what=f"coordinator {other} leading while {name} is stopped")
            finally:
                self.cluster.signal_coordinator(name, signal.SIGCONT)
            self.cluster.wait_coordinators()
            fault.accounted = f"{other} took over; {name} resumed"
            return False
        name = self.rng.choice(sorted(self.cluster.etcd.members))
        # At most the agents' lease TTL less one keep-alive interval (TTL/3):
        # then no lease can lapse during the stall even if the stopped member
        # leads and no other is elected. Longer stalls of the leader can expire
        # the agents' leases (seen: leader stopped 3.9 s against a 3 s TTL,
        # seed 2726525854, two nodes lost): beyond this soak's guarantee, an
        # open finding (docs/benchmarks.md, "Chaos soak").
        held = self.rng.uniform(1.0, LEASE_TTL_S * 2 / 3)
        fault.target = f"SIGSTOP etcd {name} for {held:.1f} s"
        self.cluster.etcd.pause(name)
        try:
            time.sleep(held)  # the fault lasts this long
        finally:
            self.cluster.etcd.resume(name)
        fault.accounted = f"etcd {name} stopped {held:.1f} s; no node_lost expected"
        return False
