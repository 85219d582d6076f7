"""Run one job's worker group on this node (the process is ``python -m agent.runner SPEC.json``).

The agent daemon starts one runner process per assigned job, so that one
job's crash cannot take the daemon down. The runner drives torch's
``LocalElasticAgent`` on the etcd-v3 rendezvous (run id = job id) with four
changes, in :class:`TidalElasticAgent` (five, with the in-place recovery):

* **membership changes are not failures.** torch charges every worker failure
  to the restart budget, and a dead peer makes the survivors' workers fail.
  Here a failure is charged only if the new rendezvous round has the same
  members as the last one; when a peer left or joined, it is counted as a
  ``node_lost`` / ``membership_changed`` restart instead. What a failure or a
  change costs, and what the runner does next, is decided by the pure
  functions of :mod:`agent.runner.restarts`; the monitor loop here carries it out;
* **leaving is not ending.** On SIGTERM (the assignment was removed, or the
  node drains) the workers get SIGTERM, then SIGKILL after the grace period,
  and the runner leaves the rendezvous without closing it, so the other nodes
  go on without it; torch's launcher would close it for everyone;
* **a lost member is recovered in place.** When a peer dies and every local
  worker can take the live path, the survivors keep their processes: the
  runner tells them at once (``live-lost.json``), forms the next round without
  the dead member and tells them that round as for a planned change; they
  discard the step in flight and re-form their group (:mod:`checkpoints.live`);
* **planned changes are live.** When a node joins or announces that it
  leaves, and every local worker can take the live path (:mod:`agent.runner.live_decide`),
  the runner forms the next round while its workers train and tells them the
  new membership; they re-form their process group in place. A leaving node
  (SIGTERM) announces it, tells its workers, and waits for them to exit once
  the others resized. Whatever goes wrong (a worker that does not answer in
  ``live_timeout``, one that exits, another change meanwhile) falls back to
  the restart path, and the status and metrics say which path was taken.
  The runner carries this out in :class:`agent.runner.live_path.LivePath`, a mixin;
* **status** goes to etcd (:mod:`agent.runner.status`), with the root cause of a
  failure: exit code, signal, and the traceback from the error file torch's
  ``@record`` writes, or the tail of the rank's stderr.

Every worker is started through :mod:`agent.workers.shim` and dies with the
runner; the runner dies with the daemon (:mod:`agent.workers.lifeline`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

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

from agent import rundir
from agent.bounds import BoundsFollower
from agent.runner import restarts
from agent.runner.elastic_metrics import configure_elastic_metrics
from agent.runner.live_path import LIVE_TIMEOUT_S, LivePath, alive
from agent.runner.restarts import Action
from agent.runner.setup import initial_status, make_handler, make_worker_spec
from agent.runner.status import StatusReporter
from agent.runner.torch_compat import SHUTDOWN_TAKES_TIMEOUT, agent_kwargs, check_torch
from agent.runner_metrics import RESTART, RUNNER_METRICS_FILE
from agent.spec import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED, RunnerSpec
from agent.workers.logcap import LogCap
from agent.workers.zygote import ZygoteProcess
from checkpoints.protocol.jit import DONE, clear_reports, keep_waiting, read_reports, write_notice
from checkpoints.protocol.live import clear_live_files
from rendezvous.elastic.assigned import AssignedRendezvousHandler, AssignmentWithdrawnError
from rendezvous.elastic.assigned_rounds import LOST, WAITING, Change
from rendezvous.etcd import create_client
from rendezvous.keys import Keys
from rendezvous.records import (
    JobNodeState,
    RestartReason,
    WorkerError,
)

log = logging.getLogger("tidal.runner")

# Workers of a group that failed or lost a peer are blocked in a collective
# that will not complete; SIGTERM cannot save anything there.
FAILED_STOP_TIMEOUT_S = 2.0
# Before that, workers on the checkpoints library save the last completed
# step (checkpoints.jit): each is waited for while its report shows progress.
# An armed worker has JIT_ACK_S after the notice to start saving (a watcher
# thread polls every 50 ms); a save that shows no progress for JIT_STALL_S is
# given up on; the whole wait never exceeds the job's grace period.
JIT_ACK_S = 0.5
JIT_STALL_S = 2.0
# How long a new runner waits for its zygote (agent.workers.zygote) before joining.
ZYGOTE_READY_TIMEOUT_S = 60.0
# Between two looks at the workers (torch's monitor_interval, 0.1 s), how often the
# monitor loop asks the rendezvous for a change: a lost peer is known locally the
# moment its liveness socket closes, and every millisecond until the runner acts is
# a millisecond of the survivors' pause (a 0.1-s sleep cost 50 ms of a kill, on average).
CHANGE_POLL_S = 0.01


#: What torch elastic puts in a failure's message when the worker wrote no error file
#: (its script has no ``@record``): a pointer to its docs, not the error.
TORCH_NO_ERROR_FILE = "To enable traceback"

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)(:\s|$)")


def error_line(output: str) -> str:
    """The line of a worker's output that names its error: the last exception line
    (``ValueError: ...``) after the last traceback, else the last line that is not
    torch's pointer to its docs; "" if there is none."""
    lines = [line.strip() for line in output.splitlines()]
    lines = [line for line in lines if line and not line.startswith(TORCH_NO_ERROR_FILE)]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines else ""


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
    if not message or message.startswith(TORCH_NO_ERROR_FILE):
        message = error_line(traceback) or message
    signal_name = failure.signal_name() if failure.exitcode < 0 else None
    return WorkerError(
        rank=rank,
        exit_code=failure.exitcode,
        signal=signal_name,
        message=message[-4000:],
        traceback=traceback[-60000:],
    )


class TidalElasticAgent(LivePath, LocalElasticAgent):
    """LocalElasticAgent that tells membership changes from failures and reports status.

    Its rendezvous handler is an :class:`AssignedRendezvousHandler`, whose
    :meth:`~AssignedRendezvousHandler.pending_change` says, on every monitor
    tick and without an etcd call, whether a peer was lost, a node is waiting
    to join, or the others went on without this node.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        reporter: StatusReporter,
        progress_dir: Path | None = None,
        live_timeout_s: float = LIVE_TIMEOUT_S,
        shutdown_timeout: int = 30,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, **agent_kwargs(shutdown_timeout=shutdown_timeout, **kwargs))
        # Every node of a job runs nproc_per_node workers (one field of the job): torch
        # elastic then computes the ranks from the node's rank (``_assign_worker_ranks``'
        # fast path) instead of exchanging them through the round's store, which waits
        # for every member, a dead one too (a round formed a moment before a member died
        # held the runner there until the store's timeout). Set here, after the zygote's
        # environment was compared with the job's (agent.runner.__main__).
        os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
        # torch 2.11 keeps none (agent.runner.torch_compat); 2.12 on set the same.
        self._shutdown_timeout = shutdown_timeout
        # Where the workers' progress, just-in-time save and live resize files are.
        self._progress_dir = progress_dir
        if progress_dir is not None:
            clear_reports(progress_dir)
            clear_live_files(progress_dir)
        self._live_timeout_s = live_timeout_s
        self._resizing = False  # a live resize is under way: no planned leave now
        if not isinstance(spec.rdzv_handler, AssignedRendezvousHandler):
            raise TypeError("TidalElasticAgent needs an AssignedRendezvousHandler")
        self._handler: AssignedRendezvousHandler = spec.rdzv_handler
        self._reporter = reporter
        # The job's worker-failure budget, charged as agent.runner.restarts decides.
        # torch's own ``_remaining_restarts`` is decremented on *every*
        # restart instead, membership changes included, because torch derives
        # TORCHELASTIC_RESTART_COUNT and the log directory (``attempt_N``)
        # from it: otherwise each restart after a lost or joining node would
        # overwrite the previous attempt's logs.
        self._budget = spec.max_restarts
        # How long stopped workers get between SIGTERM and SIGKILL. A group
        # restarted because a worker or a peer failed is stuck in a collective
        # that will not return: kill it quickly. A healthy group that is
        # resized gets the full grace, to checkpoint at its next step.
        self._grace_s = float(shutdown_timeout)
        self._stop_timeout_s = self._grace_s

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        try:
            super()._rendezvous(worker_group)
        finally:
            self._reporter.rendezvous_done(time.monotonic() - started)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        broken = self._stop_timeout_s <= FAILED_STOP_TIMEOUT_S
        log.info("stopping the %s worker group", "broken" if broken else "healthy")
        if broken and self._progress_dir is not None and self._await_jit_saves():
            # Every worker that could save has saved: nothing is left to lose.
            self._close_workers(signal.SIGKILL, timeout=1)
        else:
            self._close_workers(signal.SIGTERM, timeout=int(max(1, self._stop_timeout_s)))
        if self._progress_dir is not None:
            clear_reports(self._progress_dir)
            clear_live_files(self._progress_dir)

    def _close_workers(self, death_sig: signal.Signals, *, timeout: int) -> None:
        """torch's ``_shutdown`` with a SIGKILL ``timeout`` s after ``death_sig``, on every
        supported torch: 2.11's ``_shutdown`` takes no timeout and would wait 30 s, so its
        process context is closed here first (torch's own close then finds the workers gone)."""
        if SHUTDOWN_TAKES_TIMEOUT:
            self._shutdown(death_sig=death_sig, timeout=timeout)
            return
        if self._pcontext is not None:
            self._pcontext.close(death_sig, timeout)
        self._shutdown(death_sig=death_sig)

    def _await_jit_saves(self) -> bool:
        """Tell the workers a peer is gone; wait for their just-in-time saves (bounded).

        Returns whether every worker that reported is done with its save (or
        exited) and at least one saved: the group may then be killed at once.
        """
        assert self._progress_dir is not None
        reports = read_reports(self._progress_dir)
        if not reports:
            return False  # no worker uses the checkpoints library's just-in-time save
        noticed = time.monotonic()
        write_notice(self._progress_dir, "a peer is gone")
        seen: dict[int, tuple[str, int]] = {}
        progress_at: dict[int, float] = {}
        while True:
            now = time.monotonic()
            reports = read_reports(self._progress_dir)
            for rank, report in reports.items():
                if seen.get(rank) != (report.state, report.bytes):
                    seen[rank] = (report.state, report.bytes)
                    progress_at[rank] = now
            if not keep_waiting(
                reports, now=now, noticed_at=noticed, progress_at=progress_at, alive=alive,
                ack_s=JIT_ACK_S, stall_s=JIT_STALL_S, max_s=self._grace_s,
            ):
                break
            time.sleep(0.02)
        waited = time.monotonic() - noticed
        states = ", ".join(f"rank {r} {rep.state} step {rep.step}"
                           for r, rep in sorted(reports.items()))
        log.info("waited %.2f s for just-in-time saves (%s)", waited, states)
        return any(r.state == DONE for r in reports.values()) and all(
            r.finished or not alive(r.pid) for r in reports.values()
        )

    def _report_running(self) -> None:
        group = self._worker_group
        self._reporter.update(
            state=JobNodeState.RUNNING,
            world_size=group.spec.local_world_size * (group.group_world_size or 0),
            ranks=sorted(w.global_rank for w in group.workers),
            remaining_restarts=self._budget,
        )

    def _notice_recovery(self, at: float | None = None) -> None:
        """A failure or membership change is noticed: the recovery clock starts."""
        restarts = self._worker_group.spec.max_restarts - self._remaining_restarts
        self._reporter.recovery_noticed(restart_count=restarts, at=at)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return self._run_group()
        except SignalException as exc:
            if exc.sigval == signal.SIGTERM:
                self._leave_live()
            if not SHUTDOWN_TAKES_TIMEOUT and self._pcontext is not None:
                # torch 2.11's run() closes the workers with PContext's own 30 s, not
                # the grace (or what a planned leave left of it): close them here.
                self._pcontext.close(exc.sigval, self._shutdown_timeout)
            raise

    def _run_group(self) -> RunResult:
        """torch's monitor loop, with tidal's decisions (agent.runner.restarts) where it meets
        an event."""
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        members = self._handler.participants()
        self._report_running()
        while True:
            self._await_change(spec.monitor_interval)
            result: RunResult = self._monitor_workers(self._worker_group)
            self._worker_group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._reporter.count_exits([0] * spec.local_world_size)
                self._exit_barrier()  # type: ignore[no-untyped-call]
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                new_members = self._after_failure(result, members)
                if new_members is None:
                    return result
                members = new_members
                continue
            change = self._handler.pending_change()
            if change is not None:
                members = self._after_change(change, members)

    def _await_change(self, seconds: float) -> None:
        """Sleep until the next look at the workers, or until the rendezvous says this
        node's round is obsolete (:data:`CHANGE_POLL_S`), whichever comes first. A change
        still pending from the last look (one the loop does not act on) sleeps it all."""
        if self._handler.pending_change() is not None:
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(CHANGE_POLL_S, left))
            if self._handler.pending_change() is not None:
                return

    def _after_failure(self, result: RunResult, members: frozenset[str]) -> frozenset[str] | None:
        """The group failed: stop it, form the next round, then restart it or fail
        (:func:`agent.runner.restarts.after_failure`). Returns the new round's members,
        None when the job fails here."""
        stderrs = dict(getattr(self._pcontext, "stderrs", {}) or {})
        self._notice_recovery()
        self._reporter.count_exits(f.exitcode for f in result.failures.values())
        self._reporter.update(error=root_cause(result.failures, stderrs))
        self._stop_broken_group()
        self._rendezvous(self._worker_group)
        new_members = self._handler.participants()
        step = restarts.after_failure(self._budget, members, new_members)
        self._budget = step.budget
        self._reporter.count_restart(step.reason or RestartReason.WORKER_FAILED,
                                     remaining_restarts=self._budget)
        if step.action is Action.FAIL:
            log.error("worker group failed and the restart budget is spent")
            self._handler.leave()
            self._worker_group.state = WorkerState.FAILED
            return None
        if step.resize is not None:
            self._reporter.count_resize(RESTART, step.resize)
            log.info("a peer left or joined: restarting without charging the budget")
        self._remaining_restarts -= 1  # the next attempt: see __init__
        self._start_group()
        return new_members

    def _after_change(self, change: Change, members: frozenset[str]) -> frozenset[str]:
        """This node's round is obsolete: resize live, or restart the group
        (:func:`agent.runner.restarts.for_change`). Returns the new round's members."""
        # A worker that caught a failed collective already: a member is lost, whatever
        # this node saw first (a join or leave announced just before the death).
        lost = change.kind == LOST or (change.kind in restarts.PLANNED
                                       and self._caught_failure())
        step = restarts.for_change(LOST if lost else change.kind, self._budget,
                                   lambda: self._live_blocker(lost=lost))
        if step.action is Action.LIVE:
            return self._live_resize(change, members, lost=lost)
        self._notice_recovery()
        nodes = ", ".join(sorted(change.nodes)) or "-"
        if step.broken:
            # A peer is gone (or the others went on without us): the group
            # is broken and its collectives will not complete.
            log.warning("peer(s) %s lost (%s): restarting without them%s", nodes, change.kind,
                        f" (not in place: {step.fallback})" if step.fallback else "")
            self._stop_timeout_s = FAILED_STOP_TIMEOUT_S
        else:
            # A healthy group: give the workers their grace to checkpoint.
            log.info("node(s) %s %s: restarting the group (%s)", nodes,
                     "waiting to join" if change.kind == WAITING else "leaving", step.fallback)
            self._stop_timeout_s = self._grace_s
        self._remaining_restarts -= 1
        self._restart_workers(self._worker_group)
        new_members = self._handler.participants()
        self._reporter.count_restart(restarts.restart_reason(change.kind, members, new_members))
        self._reporter.count_resize(RESTART, step.resize or "lost", step.fallback)
        self._report_running()
        return new_members

    def _stop_broken_group(self) -> None:
        """Stop a group that failed, lost a peer or did not resize live: quickly."""
        self._stop_timeout_s = FAILED_STOP_TIMEOUT_S
        self._stop_workers(self._worker_group)
        self._worker_group.state = WorkerState.STOPPED

    def _start_group(self) -> None:
        worker_ids = self._start_workers(self._worker_group)
        for local_rank, worker_id in worker_ids.items():
            self._worker_group.workers[local_rank].id = worker_id
        self._worker_group.state = WorkerState.HEALTHY
        self._report_running()


def _ignore_stop_requests() -> None:
    """From here on the outcome is decided; let a SIGTERM not interrupt reporting it.

    The coordinator removes a finished job's assignments as soon as one node
    reports, so the daemon SIGTERMs runners that are still closing down;
    torch's handler would raise in the middle of a status write or of the
    zygote's close. The daemon SIGKILLs a runner that lingers past its grace.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run(spec: RunnerSpec, *, progress_dir: Path, zygote: ZygoteProcess | None) -> int:
    """Run the job's worker group until it succeeds, fails, or this node leaves.

    The environment is prepared and the zygote started by :mod:`agent.runner`,
    before this module's imports (torch) take their second and a half.
    """
    check_torch()  # a torch whose elastic agent moved: refuse, naming the supported ones
    job = spec.assignment
    client = create_client(spec.etcd)
    reporter = StatusReporter(
        client,
        initial_status(spec, os.getpid()),
        progress_dir=progress_dir,
        metrics_path=spec.job_dir / RUNNER_METRICS_FILE,
        # A runner that replaces a dead one of this generation goes on counting.
        resume_metrics=spec.prior is not None,
    ).start()
    configure_elastic_metrics(reporter.recorder)
    keys = Keys(spec.etcd.root)
    conf = job.rdzv_conf
    handler = make_handler(spec, client, keys)
    agent = TidalElasticAgent(
        make_worker_spec(spec, handler, remaining_restarts=reporter.status.remaining_restarts),
        reporter=reporter,
        progress_dir=progress_dir,
        live_timeout_s=float(conf.get("live_timeout", LIVE_TIMEOUT_S)),
        logs_specs=DefaultLogsSpecs(log_dir=str(rundir.logs_dir(spec.job_dir)), redirects=Std.ALL),
        start_method="spawn",
        shutdown_timeout=int(job.grace_period_s),
    )
    # New bounds written into the assignment in place (a PATCH) reach the
    # rendezvous without a restart (agent.bounds).
    bounds = BoundsFollower(client, keys.assignment(spec.node_id, job.job_id), job.generation,
                            on_change=handler.set_bounds).start()
    cap = LogCap(rundir.logs_dir(spec.job_dir), max_bytes=spec.log_max_bytes).start()
    # Join the job only once workers can start fast: the running nodes keep
    # training meanwhile instead of waiting for this node's imports.
    if zygote is not None and not zygote.wait_ready(ZYGOTE_READY_TIMEOUT_S):
        log.warning("the zygote is not ready: workers start without it")
    try:
        result = agent.run()
    except SignalException as exc:
        _ignore_stop_requests()
        log.info("stopping on %s: leaving the job (the others go on)", exc.sigval.name)
        handler.leave()
        reporter.update(state=JobNodeState.CANCELLED)
        return EXIT_STOPPED
    except AssignmentWithdrawnError as exc:
        # The coordinator took this node out of the job (or gave it a new
        # generation) while this runner could not see it: its agent stops it.
        _ignore_stop_requests()
        log.warning("%s: leaving the job", exc)
        handler.leave()
        reporter.update(state=JobNodeState.CANCELLED)
        return EXIT_STOPPED
    finally:
        _ignore_stop_requests()
        bounds.stop()
        cap.close()
        reporter.close()
    if result.is_failed():
        reporter.update(state=JobNodeState.FAILED)
        handler.leave()
        return EXIT_FAILED
    reporter.update(state=JobNodeState.SUCCEEDED)
    handler.shutdown()  # the job is done: close the rendezvous for everyone
    return EXIT_SUCCEEDED

