"""Run one job's worker group on this node: ``python -m agent.runner SPEC.json``.

The agent daemon starts one runner process per assigned job, so that one
job's crash cannot take the daemon down. The runner drives torch's
``LocalElasticAgent`` on the etcd-v3 rendezvous (run id = job id) with three
changes, in :class:`TidalElasticAgent`:

* **membership changes are not failures.** torch charges every worker failure
  to the restart budget, and a dead peer makes the survivors' workers fail.
  Here a failure is charged only if the new rendezvous round has the same
  members as the last one; when a peer left or joined, it is counted as a
  ``node_lost`` / ``membership_changed`` restart instead;
* **leaving is not ending.** On SIGTERM (the assignment was removed, or the
  node drains) the workers get SIGTERM, then SIGKILL after the grace period,
  and the runner leaves the rendezvous without closing it, so the other nodes
  go on without it; torch's launcher would close it for everyone;
* **status** goes to etcd (:mod:`agent.status`), with the root cause of a
  failure: exit code, signal, and the traceback from the error file torch's
  ``@record`` writes, or the tail of the rank's stderr.

Every worker is started through :mod:`agent.worker_shim` and dies with the
runner; the runner dies with the daemon (:mod:`agent.lifeline`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from agent.elastic_metrics import configure_elastic_metrics
from agent.lifeline import die_with_parent
from agent.logcap import LogCap
from agent.netif import socket_interface_env
from agent.spec import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED, RunnerSpec
from agent.status import RUNNER_METRICS_FILE, StatusReporter
from rendezvous.client import create_client
from rendezvous.records import (
    JobNodeState,
    JobNodeStatus,
    RestartReason,
    WorkerError,
)
from rendezvous.torch_backend import EtcdV3RendezvousBackend, create_handler_and_backend

log = logging.getLogger("tidal.runner")

# Workers of a group that failed or lost a peer are blocked in a collective
# that will not complete; SIGTERM cannot save anything there.
FAILED_STOP_TIMEOUT_S = 2.0


def _participants(handler: RendezvousHandler) -> frozenset[str]:
    """The members of the handler's last rendezvous round.

    Reads DynamicRendezvousHandler's state holder, a private attribute; if a
    torch release renames it, every failure is charged to the budget (torch's
    own behaviour) and a warning says so.
    """
    try:
        state = handler._state_holder.state  # type: ignore[attr-defined]
        return frozenset(str(node) for node in state.participants)
    except AttributeError:
        log.warning("cannot read rendezvous membership; charging every failure to the budget")
        return frozenset()


def _leave_rendezvous(handler: RendezvousHandler) -> None:
    """Remove this node from the rendezvous without closing it for the others."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()  # type: ignore[attr-defined]
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10)  # type: ignore[attr-defined]
    except Exception as exc:  # best effort: our heartbeats stop and expire anyway
        log.warning("could not leave the rendezvous cleanly (%s); it will time us out", exc)


def membership_reason(old: frozenset[str], new: frozenset[str]) -> RestartReason | None:
    """Why a restart happened, judged by the rounds' members: None if they are the same.

    A peer that vanished makes the survivors' workers fail and, seen from
    another survivor, shows up as a node "waiting to join" (the survivor that
    noticed first re-joins). Only the membership diff tells the two apart.
    """
    if not old or not new or old == new:
        return None
    if old - new and new - old:
        return RestartReason.MEMBERSHIP_CHANGED
    return RestartReason.NODE_LOST if old - new else RestartReason.NODE_JOINED


def root_cause(failures: dict[int, ProcessFailure], stderrs: dict[int, str]) -> WorkerError | None:
    """The first failure by time, with its traceback (error file, else stderr tail)."""
    if not failures:
        return None
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    message = failure.message if isinstance(failure.message, str) else ""
    traceback = ""
    data: Any = failure.error_file_data.get("message") if failure.error_file_data else None
    if isinstance(data, dict):
        traceback = str(data.get("extraInfo", {}).get("py_callstack", ""))
        message = str(data.get("message", message))
    if not traceback:
        path = stderrs.get(failure.local_rank, "")
        try:
            lines = Path(path).read_text(errors="replace").splitlines() if path else []
            traceback = "\n".join(lines[-60:])
        except OSError:
            pass
    signal_name = failure.signal_name() if failure.exitcode < 0 else None
    return WorkerError(
        rank=rank,
        exit_code=failure.exitcode,
        signal=signal_name,
        message=message[-4000:],
        traceback=traceback[-60000:],
    )


class TidalElasticAgent(LocalElasticAgent):
    """LocalElasticAgent that tells membership changes from failures and reports status."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        reporter: StatusReporter,
        backend: EtcdV3RendezvousBackend | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, **kwargs)
        self._reporter = reporter
        self._backend = backend
        # The job's worker-failure budget. torch's own ``_remaining_restarts``
        # is decremented on *every* restart instead, membership changes
        # included, because torch derives TORCHELASTIC_RESTART_COUNT and the
        # log directory (``attempt_N``) from it: otherwise each restart after a
        # lost or joining node would overwrite the previous attempt's logs.
        self._budget = spec.max_restarts
        # How long stopped workers get between SIGTERM and SIGKILL. A group
        # restarted because a worker or a peer failed is stuck in a collective
        # that will not return: kill it quickly. A healthy group that is
        # resized gets the full grace, to checkpoint at its next step.
        self._grace_s = float(kwargs.get("shutdown_timeout", 30))
        self._stop_timeout_s = self._grace_s
        settings = getattr(spec.rdzv_handler, "settings", None)
        window = 10.0
        if settings is not None:
            window = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
        self._liveness_window_s = 2 * window

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=int(max(1, self._stop_timeout_s)))

    def _report_running(self) -> None:
        group = self._worker_group
        self._reporter.update(
            state=JobNodeState.RUNNING,
            world_size=group.spec.local_world_size * (group.group_world_size or 0),
            ranks=sorted(w.global_rank for w in group.workers),
            remaining_restarts=self._budget,
        )

    def _notice_recovery(self) -> None:
        """A failure or membership change is noticed: the recovery clock starts."""
        restarts = self._worker_group.spec.max_restarts - self._remaining_restarts
        self._reporter.recovery_noticed(restart_count=restarts)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        members = _participants(spec.rdzv_handler)
        self._report_running()
        while True:
            time.sleep(spec.monitor_interval)
            result: RunResult = self._monitor_workers(self._worker_group)
            self._worker_group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._reporter.count_exits([0] * spec.local_world_size)
                self._exit_barrier()  # type: ignore[no-untyped-call]
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                stderrs = dict(getattr(self._pcontext, "stderrs", {}) or {})
                self._notice_recovery()
                self._reporter.count_exits(f.exitcode for f in result.failures.values())
                self._reporter.update(error=root_cause(result.failures, stderrs))
                self._stop_timeout_s = FAILED_STOP_TIMEOUT_S
                self._stop_workers(self._worker_group)
                self._worker_group.state = WorkerState.STOPPED
                self._rendezvous(self._worker_group)
                new_members = _participants(spec.rdzv_handler)
                reason = membership_reason(members, new_members)
                self._reporter.count_restart(reason or RestartReason.WORKER_FAILED)
                if reason is not None:
                    log.info("a peer left or joined: restarting without charging the budget")
                elif self._budget > 0:
                    self._budget -= 1
                else:
                    log.error("worker group failed and the restart budget is spent")
                    _leave_rendezvous(spec.rdzv_handler)
                    self._worker_group.state = WorkerState.FAILED
                    return result
                members = new_members
                self._remaining_restarts -= 1  # the next attempt: see __init__
                self._start_group()
            elif spec.rdzv_handler.num_nodes_waiting() > 0:
                log.info("nodes are waiting to join: restarting with them")
                self._notice_recovery()
                self._stop_timeout_s = self._grace_s
                self._remaining_restarts -= 1
                self._restart_workers(self._worker_group)
                new_members = _participants(spec.rdzv_handler)
                reason = membership_reason(members, new_members) or RestartReason.NODE_JOINED
                self._reporter.count_restart(reason)
                members = new_members
                self._report_running()
            else:
                members = self._check_peers(members)

    def _check_peers(self, members: frozenset[str]) -> frozenset[str]:
        """Restart if a peer of this round stopped heartbeating (hung or partitioned).

        torch notices a silent peer only when a collective times out (gloo's
        default: 30 minutes). The rendezvous state, synced by
        ``num_nodes_waiting`` just before, drops a participant whose
        heartbeats stopped for keep-alive x attempts; that is our signal.
        Right after an etcd outage every heartbeat is stale, so the membership
        is re-read instead of trusted.
        """
        handler = self._worker_group.spec.rdzv_handler
        current = _participants(handler)
        if not members or not current:
            return current or members
        if self._backend is not None and self._backend.outage_within(self._liveness_window_s):
            return current
        lost = members - current
        if not lost:
            return members
        log.warning("%d peer(s) stopped heartbeating: restarting without them", len(lost))
        self._notice_recovery()
        self._reporter.count_restart(RestartReason.NODE_LOST)
        self._stop_timeout_s = FAILED_STOP_TIMEOUT_S
        self._remaining_restarts -= 1
        self._restart_workers(self._worker_group)
        self._report_running()
        return _participants(handler)

    def _start_group(self) -> None:
        worker_ids = self._start_workers(self._worker_group)
        for local_rank, worker_id in worker_ids.items():
            self._worker_group.workers[local_rank].id = worker_id
        self._worker_group.state = WorkerState.HEALTHY
        self._report_running()


def _prepare_environment(spec: RunnerSpec) -> Path:
    """Working directory and environment the workers inherit; returns the progress dir."""
    job = spec.assignment
    progress_dir = spec.job_dir / "progress"
    progress_dir.mkdir(parents=True, exist_ok=True)
    if job.cwd:
        os.chdir(job.cwd)
    os.environ.update(job.env)
    os.environ.update(
        {
            "TIDAL_JOB_ID": job.job_id,
            "TIDAL_NODE_ID": spec.node_id,
            "TIDAL_PROGRESS_DIR": str(progress_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if job.checkpoint_dir:
        os.environ["TIDAL_CHECKPOINT_DIR"] = job.checkpoint_dir
    # Collectives go over the interface other nodes reach this one at.
    os.environ.update(socket_interface_env(spec.address, job.env))
    return progress_dir


def run(spec: RunnerSpec) -> int:
    """Run the job's worker group until it succeeds, fails, or this node leaves."""
    job = spec.assignment
    progress_dir = _prepare_environment(spec)
    client = create_client(spec.etcd)
    reporter = StatusReporter(
        client,
        JobNodeStatus(
            job_id=job.job_id,
            node_id=spec.node_id,
            generation=job.generation,
            state=JobNodeState.STARTING,
            remaining_restarts=job.max_restarts,
            pid=os.getpid(),
        ),
        progress_dir=progress_dir,
        metrics_path=spec.job_dir / RUNNER_METRICS_FILE,
    ).start()
    configure_elastic_metrics(reporter.recorder)
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=",".join(spec.etcd.endpoints),
        run_id=job.job_id,
        min_nodes=job.min_nodes,
        max_nodes=job.max_nodes,
        local_addr=spec.address,
        key_root=spec.etcd.root,
        **job.rdzv_conf,
    )
    handler, backend = create_handler_and_backend(params, client=client)
    worker_spec = WorkerSpec(
        role="trainer",
        local_world_size=job.nproc_per_node,
        entrypoint=sys.executable,
        args=("-m", "agent.worker_shim", str(os.getpid()), "--", *job.command),
        rdzv_handler=handler,
        max_restarts=job.max_restarts,
        monitor_interval=0.1,
        local_addr=spec.address,
    )
    agent = TidalElasticAgent(
        worker_spec,
        reporter=reporter,
        backend=backend,
        logs_specs=DefaultLogsSpecs(log_dir=str(spec.job_dir / "logs"), redirects=Std.ALL),
        start_method="spawn",
        shutdown_timeout=int(job.grace_period_s),
    )
    cap = LogCap(spec.job_dir / "logs", max_bytes=spec.log_max_bytes).start()
    try:
        result = agent.run()
    except SignalException as exc:
        log.info("stopping on %s: leaving the job (the others go on)", exc.sigval.name)
        _leave_rendezvous(handler)
        reporter.update(state=JobNodeState.CANCELLED)
        return EXIT_STOPPED
    finally:
        cap.close()
        reporter.close()
    if result.is_failed():
        reporter.update(state=JobNodeState.FAILED)
        return EXIT_FAILED
    reporter.update(state=JobNodeState.SUCCEEDED)
    handler.shutdown()  # the job is done: close the rendezvous for everyone
    return EXIT_SUCCEEDED


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m agent.runner SPEC.json\n")
        return 2
    spec = RunnerSpec.model_validate_json(Path(argv[0]).read_text())
    # The password comes through the environment, never the spec file; the
    # workers inherit this process's environment, so take it out.
    password = os.environ.pop("TIDAL_ETCD_PASSWORD", None)
    spec = spec.model_copy(
        update={"etcd": spec.etcd.model_copy(update={"password": SecretStr(password)})}
        if password
        else {"etcd": spec.etcd.model_copy(update={"password": None})}
    )
    die_with_parent(expected_parent=spec.parent_pid)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s runner[{spec.assignment.job_id}] %(name)s: %(message)s",
    )
    return run(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
