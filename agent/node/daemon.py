"""The node agent daemon: register the node, follow its assignments, run them.

:class:`Agent` registers the node in etcd under a lease (the coordinator sees
it alive exactly as long as the agent keeps the lease), watches
``assignments/<node>/`` with a list-then-watch :class:`PrefixWatcher`, and
reconciles, level-triggered, what should run against what runs. Each pass
decides first, without acting (:mod:`agent.node.plan`, :mod:`agent.node.supervise`,
:mod:`agent.node.warm_policy`), then carries the decision out:

* an assignment without a runner: start ``python -m agent.runner`` for it
  (one process per job, so one job cannot take the daemon down);
* a runner whose assignment is gone (cancelled, scaled down, drained): SIGTERM
  it (its workers get SIGTERM, checkpoint and exit; the node leaves the
  rendezvous, the others go on), then SIGKILL after the grace period;
* an assignment rewritten in place (the same generation, new bounds only: a
  PATCH, :mod:`agent.bounds`): the runner goes on, and follows the bounds
  itself; the daemon takes them over once the job's record confirms them;
* a runner that exited: remember the generation, never rerun it; if it
  could not say how its job ended (SIGKILLed, crashed), write that in its
  place and restart it, charged to the job's budget, or fail the job with
  the root cause (:mod:`agent.node.supervise`). A runner that cannot be started
  counts as one that crashed. Nothing the daemon's bookkeeping throws stops
  its loop: the next pass (within half a second) tries again.

The node record, and what a GPU that fails or GPUs not free do to a job, are
:mod:`agent.node.offer`'s.

Warm runners: the daemon keeps one runner started ahead of the next job, so
that a job starts (or a runner that died is replaced) without ``python`` +
``import torch`` first (:mod:`agent.node.warm_policy` says when and why,
:class:`agent.node.launch.WarmRunner` starts and hands it over).

Runners are started from the main thread with the parent-death signal set, so
a SIGKILLed daemon takes its runners, and they their workers, with it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from agent import rundir
from agent.admission import AssignmentGate
from agent.gpu.metrics import GpuCollector
from agent.node.gpus import NodeGpus, NoDevicesError
from agent.node.launch import WarmRunner, start_cold, write_spec
from agent.node.logserve import LogServer, new_token
from agent.node.metrics import SCALED, AgentMetrics, JobStatusCollector
from agent.node.offer import NodeOffer, held_devices
from agent.node.plan import RunnerPlan, RunnerView, choose_assignment, plan_runners
from agent.node.settings import AgentSettings
from agent.node.supervise import Action, after_exit
from agent.node.warm_policy import wants_warm_runner
from agent.spec import (
    EXIT_CRASHED,
    EXIT_FAILED,
    EXIT_STOPPED,
    OUTCOME_FILE,
    RunnerOutcome,
    RunnerSpec,
    read_outcome,
)
from agent.workers.jobpaths import JobSetupError, check_job_paths
from agent.workers.user import lookup, private_dir
from rendezvous.errors import EtcdError, EtcdUnavailableError
from rendezvous.etcd import EtcdClient, WatchEvent, create_client_waiting
from rendezvous.records import (
    Assignment,
    JobNodeStatus,
    RestartReason,
    utcnow,
)
from rendezvous.registry import LogEndpoint, NodeRegistration
from rendezvous.watch import PrefixWatcher

log = logging.getLogger(__name__)


@dataclass
class _Runner:
    assignment: Assignment
    process: subprocess.Popen[bytes]
    log_path: Path  # runner.log, or runner-<pid>.log for a warm runner that replaced one
    stop_deadline: float | None = None  # set once SIGTERM was sent
    devices: list[int] | None = None  # its GPUs (agent.node.gpus); None on a CPU node


@dataclass
class _Exited:
    """A runner that has exited, whose aftermath (agent.node.supervise) is not written yet."""

    assignment: Assignment
    pid: int
    code: int
    stopping: bool
    outcome: RunnerOutcome | None = None  # its own, or the daemon's when it never started
    log_path: Path | None = None  # its log, if it started


#: Bytes of a dead runner's log kept as its root cause's text.
LOG_TAIL_BYTES = 16 * 1024


@dataclass
class AgentState:
    """What the agent runs now and what already ran, by job id."""

    runners: dict[str, _Runner] = field(default_factory=dict)
    finished: dict[str, tuple[int, int]] = field(default_factory=dict)  # job -> (generation, rc)
    exited: dict[str, _Exited] = field(default_factory=dict)  # aftermath not written yet


class Agent:
    """One node's agent. Build it with settings, then call :meth:`run`.

    Args:
        settings: this process's configuration.
    """

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.state = AgentState()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._client: EtcdClient | None = None
        self._watcher: PrefixWatcher | None = None
        self._gate: AssignmentGate | None = None  # built with the client (see _desired)
        self._jobs_lock = threading.Lock()
        self._jobs_seen: set[str] = set()
        self.metrics: AgentMetrics | None = None
        self.metrics_port: int | None = None
        self.warm = WarmRunner(settings)
        self._logs: LogServer | None = None
        self.gpus = NodeGpus(settings)
        self.offer = NodeOffer(settings, self.gpus)  # the node record, failed GPUs, none free

    def _job_ids(self) -> list[str]:
        with self._jobs_lock:
            return sorted(self._jobs_seen)

    def _serve_metrics(self, client: EtcdClient) -> None:
        port = self.settings.metrics_port
        if port is None:
            return
        registry = CollectorRegistry()
        self.metrics = AgentMetrics(registry, slots=self.gpus.slots)
        registry.register(GpuCollector(
            self.settings.node_id, lambda: self.gpus.snapshot, self._held))
        registry.register(JobStatusCollector(
            client, self.settings.node_id, self._job_ids,
            run_dir=self.settings.run_dir, extra_restarts=self.metrics.restarts,
        ))
        server, _ = self.metrics.serve(port, self.settings.metrics_host)
        self.metrics_port = int(server.server_port)
        log.info("metrics on :%d/metrics", self.metrics_port)

    def _serve_logs(self) -> None:
        """Serve the jobs' logs to the coordinator (agent.node.logserve), with a new token."""
        s = self.settings
        token = new_token()
        self._logs = LogServer(run_dir=s.run_dir, token=token, active=self._job_active,
                               host=s.metrics_host, port=s.logs_port).start()
        host = f"[{s.address}]" if ":" in s.address else s.address
        self.offer.logs = LogEndpoint(url=f"http://{host}:{self._logs.port}", token=token)
        log.info("job logs on :%d", self._logs.port)

    def _job_active(self, job_id: str) -> bool:
        """Whether ``job_id`` may still write output here: a runner, one to settle, or
        its assignment (read from the log server's threads)."""
        if job_id in self.state.runners or job_id in self.state.exited:
            return True
        watcher, client = self._watcher, self._client
        if watcher is None or client is None:
            return False
        return client.keys.assignment(self.settings.node_id, job_id) in watcher.snapshot()

    def stop(self) -> None:
        """Ask :meth:`run` to stop the runners gracefully and return."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Register, follow assignments until :meth:`stop`, then clean up."""
        settings = self.settings
        # Nobody else reads the jobs' logs and specs (workers as another user pass through).
        worker_user = lookup(settings.worker_user) if settings.worker_user else None
        private_dir(settings.run_dir, worker_user)
        self.gpus.start(on_change=self._wake.set)  # before the warm runner: slots are GPUs
        self._keep_warm()  # first: its imports overlap with everything below
        registration: NodeRegistration | None = None
        try:  # etcd may start after the agent, or be too loaded to answer at once
            self._client = client = create_client_waiting(settings.etcd_config(),
                                                          stop=self._stop)
        except BaseException as exc:
            self.warm.discard()
            self.gpus.stop()
            if isinstance(exc, EtcdUnavailableError) and self._stop.is_set():
                return  # stopped while waiting for etcd
            raise
        try:
            self._serve_logs()
            registration = self.offer.register(client, self._stop)
            self._serve_metrics(client)
            self._watcher = PrefixWatcher(
                client,
                client.keys.node_assignments_prefix(settings.node_id),
                on_event=self._on_event,
                name=f"assignments of {settings.node_id}",
            ).start()
            log.info("agent %s ready (run dir %s)", settings.node_id, settings.run_dir)
            while not self._stop.is_set():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                try:
                    self.offer.follow(self.state.runners)  # the GPUs: publish, evict
                    if self._watcher.synced:
                        self.reconcile(self._desired())
                    self._keep_warm()
                except Exception:  # e.g. etcd unreachable, no memory to fork: next pass
                    log.exception("the agent's pass failed; trying again")
                    self._stop.wait(0.5)
            self._stop_all_runners()
        finally:
            self.warm.discard()
            self.gpus.stop()
            if self._watcher is not None:
                self._watcher.stop()
            if self._logs is not None:
                self._logs.close()
            if registration is not None:
                registration.deregister()
            client.close()

    # GPUs ------------------------------------------------------------------------

    def _held(self) -> dict[str, list[int]]:
        """The devices each live runner holds (one being stopped too, until it exits)."""
        return held_devices(self.state.runners)

    def _leave(self, assignment: Assignment, reason: str) -> None:
        """Leave the job on this node (status CANCELLED, why in its error: agent.node.offer):
        the coordinator takes the node out of it, as for a node that died."""
        assert self._client is not None
        self.offer.leave(self._client, assignment, reason)
        self.state.finished[assignment.job_id] = (assignment.generation, EXIT_STOPPED)

    def _on_event(self, _event: WatchEvent) -> None:
        self._wake.set()

    def _desired(self) -> dict[str, Assignment]:
        """The assignments to run: those the coordinator wrote (agent.admission).

        One not (yet) admitted never starts a runner. It does not stop one
        either: a runner whose assignment changed to one not admitted keeps
        running its admitted generation until the change is admitted or the
        assignment is deleted.
        """
        assert self._watcher is not None and self._client is not None
        if self._gate is None:
            self._gate = AssignmentGate(self._client, self.settings.node_id)
        gate = self._gate
        desired: dict[str, Assignment] = {}
        snapshot = self._watcher.snapshot()
        gate.forget_except(snapshot)
        for key, kv in snapshot.items():
            try:
                written = Assignment.model_validate_json(kv.value)
            except ValidationError as exc:
                log.error("ignoring the malformed assignment %s: %s", key, exc)
                continue
            job_id = written.job_id
            runner, exited = self.state.runners.get(job_id), self.state.exited.get(job_id)
            done = self.state.finished.get(job_id)
            chosen = choose_assignment(
                written,
                runner=runner.assignment if runner is not None else None,
                exited=exited.assignment if exited is not None else None,
                finished_generation=done[0] if done is not None else None,
                admitted=functools.partial(gate.admitted, key, kv, written),
            )
            if chosen is not None:
                desired[job_id] = chosen
        return desired

    # reconcile -----------------------------------------------------------------

    def reconcile(self, desired: dict[str, Assignment]) -> None:
        """Make the runners match ``desired``; call from the main thread only."""
        self._reap()
        for job_id in list(self.state.exited):
            try:
                self._settle(job_id, desired.get(job_id))
            except EtcdError as exc:  # not written yet: the next pass tries again
                log.warning("cannot settle the runner of %s yet: %s", job_id, exc)
            except Exception:  # never let one job's aftermath stop the others'
                log.exception("cannot settle the runner of %s yet", job_id)
        plan = plan_runners(
            desired=desired,
            runners={job_id: RunnerView(r.assignment, stopping=r.stop_deadline is not None)
                     for job_id, r in self.state.runners.items()},
            exited=self.state.exited.keys(),
            finished={job_id: generation
                      for job_id, (generation, _) in self.state.finished.items()},
        )
        self._carry_out(plan)
        if self.metrics is not None:
            used = sum(r.assignment.nproc_per_node for r in self.state.runners.values())
            self.metrics.slots_used.set(used)
            self.metrics.slots.set(self.gpus.slots)

    def _carry_out(self, plan: RunnerPlan) -> None:
        for stop in plan.stop:
            if stop.scaled:
                if self.metrics is not None:
                    self.metrics.count_restart(stop.job_id, SCALED)  # a new generation here
                # The next generation's runner is wanted as soon as this one is
                # gone: have a warm one ready by then (stopping takes seconds).
                self.warm.successor_wanted()
            self._stop_runner(stop.job_id, self.state.runners[stop.job_id])
        for wanted in plan.rebound:
            log.info("job %s: bounds now %d..%d nodes; its runner follows them",
                     wanted.job_id, wanted.min_nodes, wanted.max_nodes)
            self.state.runners[wanted.job_id].assignment = wanted
        for assignment in plan.start:
            self._start_runner(assignment)

    def _reap(self) -> None:
        now = time.monotonic()
        for job_id, runner in list(self.state.runners.items()):
            code = runner.process.poll()
            if code is not None:
                log.info("runner of %s exited with %d", job_id, code)
                del self.state.runners[job_id]
                self.state.exited[job_id] = _Exited(
                    runner.assignment, runner.process.pid, code,
                    stopping=runner.stop_deadline is not None,
                    outcome=read_outcome(self._job_dir(runner.assignment), runner.process.pid),
                    log_path=runner.log_path,
                )
            elif runner.stop_deadline is not None and now > runner.stop_deadline:
                log.warning("runner of %s ignored SIGTERM; killing it", job_id)
                with contextlib.suppress(ProcessLookupError):
                    runner.process.kill()

    def _settle(self, job_id: str, wanted: Assignment | None) -> None:
        """Write what a runner that exited left unsaid, and restart it if it is charged.

        Stays pending (retried on the next pass) while etcd cannot be read or written.
        """
        exited = self.state.exited[job_id]
        assignment = exited.assignment
        if self._client is None:
            return
        evicted = self.offer.eviction(assignment)
        if evicted is not None:
            self._leave(assignment, evicted)
            del self.state.exited[job_id]
            return
        stopping = exited.stopping or wanted is None or wanted.generation != assignment.generation
        reported = None
        if not stopping:
            kv = self._client.get(self._client.keys.status(job_id, self.settings.node_id))
            try:
                reported = JobNodeStatus.model_validate_json(kv.value) if kv else None
            except ValidationError as exc:
                log.error("ignoring the malformed status of %s: %s", job_id, exc)
        log_path = exited.log_path or self._job_dir(assignment) / rundir.RUNNER_LOG
        aftermath = after_exit(
            assignment=assignment, node_id=self.settings.node_id, pid=exited.pid,
            code=exited.code, stopping=stopping, reported=reported, outcome=exited.outcome,
            log_tail="" if stopping else _tail(log_path, LOG_TAIL_BYTES),
        )
        if aftermath.status is not None:
            status = aftermath.status.model_copy(update={"updated_at": utcnow()})
            self._client.put(self._client.keys.status(job_id, self.settings.node_id),
                             status.model_dump_json().encode())
            error = status.error.message if status.error else ""
            log.warning("job %s on this node: %s (%s)", job_id, status.state.value, error)
        del self.state.exited[job_id]
        if aftermath.action == Action.RESTART and aftermath.status is not None:
            if self.metrics is not None:
                self.metrics.count_restart(job_id, RestartReason.WORKER_FAILED.value)
            # ``wanted``: the same generation here, with the bounds taken over since.
            self._start_runner(wanted or assignment, prior=aftermath.status)
        else:
            self.state.finished[job_id] = (assignment.generation, exited.code)

    def _job_dir(self, assignment: Assignment) -> Path:
        return rundir.generation_dir(self.settings.run_dir, assignment.job_id,
                                     assignment.generation)

    def _start_runner(self, assignment: Assignment, prior: JobNodeStatus | None = None) -> None:
        """Start (or hand the warm runner) ``assignment``; a failure to start counts as a crash.

        The job's directories are checked first, here: a warm runner would
        see them only once its torch import is done (seconds on a busy node),
        and a job that cannot start should fail at once. The runner checks
        them again where it uses them (agent.workers.jobpaths).
        """
        try:
            devices = self.gpus.devices_for(assignment.job_id, assignment.gpus_per_node,
                                            self._held())
        except NoDevicesError as exc:  # wait for a stopping runner's, or leave the job
            if not self.offer.waits(assignment, str(exc), self.state.runners.values()):
                self._leave(assignment, str(exc))
            return
        self.offer.placed(assignment.job_id)
        with self._jobs_lock:
            self._jobs_seen.add(assignment.job_id)
        try:
            check_job_paths(assignment.cwd, assignment.checkpoint_dir)
        except JobSetupError as exc:
            log.error("job %s cannot start on this node: %s", assignment.job_id, exc)
            self.state.exited[assignment.job_id] = _Exited(
                assignment, 0, EXIT_FAILED, stopping=False,
                outcome=RunnerOutcome(pid=0, message=str(exc)),
            )
            return
        try:
            self._launch(assignment, prior, devices)
        except Exception as exc:
            log.exception("could not start a runner for %s", assignment.job_id)
            self.state.exited[assignment.job_id] = _Exited(
                assignment, 0, EXIT_CRASHED, stopping=False,
                outcome=RunnerOutcome(pid=0, message=f"could not start it: {exc}"),
            )

    def _launch(
        self, assignment: Assignment, prior: JobNodeStatus | None, devices: list[int] | None
    ) -> None:
        job_dir = self._job_dir(assignment)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / OUTCOME_FILE).unlink(missing_ok=True)  # a predecessor's
        spec = RunnerSpec(
            assignment=assignment,
            node_id=self.settings.node_id,
            address=self.settings.address,
            etcd=self.settings.etcd_config(),
            job_dir=job_dir.resolve(),
            parent_pid=os.getpid(),
            log_max_bytes=self.settings.log_max_bytes,
            lease_ttl_s=self.settings.lease_ttl_s,
            prior=prior,
            devices=devices,
        )
        spec_path = job_dir / rundir.RUNNER_SPEC
        write_spec(spec, spec_path)
        log_path = job_dir / rundir.RUNNER_LOG
        taken = self.warm.take(assignment.job_id, spec_path, log_path)
        if taken is not None:
            process, log_path = taken
        else:
            process = start_cold(self.settings, assignment.job_id, spec_path, log_path)
            log.info("started runner %d for job %s", process.pid, assignment.job_id)
        self.state.runners[assignment.job_id] = _Runner(assignment, process, log_path,
                                                        devices=devices)

    # warm runners ----------------------------------------------------------------

    def _keep_warm(self) -> None:
        """Start a warm runner if there is none, one is wanted and it is time
        (:mod:`agent.node.warm_policy`)."""
        if not self.settings.warm_runner:
            return
        wanted = wants_warm_runner(
            self.gpus.slots,
            [(r.assignment, r.stop_deadline is not None) for r in self.state.runners.values()],
        )
        self.warm.keep(wanted=wanted, stopping=self._stop.is_set())

    def _stop_runner(self, job_id: str, runner: _Runner) -> None:
        if runner.stop_deadline is not None:
            return
        log.info("stopping runner of %s (assignment removed or changed)", job_id)
        runner.stop_deadline = time.monotonic() + runner.assignment.grace_period_s + 10
        with contextlib.suppress(ProcessLookupError):
            runner.process.send_signal(signal.SIGTERM)

    def _stop_all_runners(self) -> None:
        for job_id, runner in list(self.state.runners.items()):
            self._stop_runner(job_id, runner)
        while self.state.runners:
            self._reap()
            time.sleep(0.1)


def _tail(path: Path, size: int) -> str:
    """The last ``size`` bytes of ``path`` from a line start, or "" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return text.partition("\n")[2] if len(data) >= size else text
