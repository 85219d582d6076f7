"""Starting a job's runner process: a cold one, or the warm one started ahead of the job.

The agent daemon (:mod:`agent.node.daemon`) decides which runners to start
(:mod:`agent.node.plan`) and when to keep a warm one (:mod:`agent.node.warm_policy`);
this module does it:

* :func:`write_spec` writes the runner's spec (it may hold etcd credentials and
  job secrets: private to the agent's user);
* :func:`start_cold` starts ``python -m agent.runner <spec>``;
* :class:`WarmRunner` keeps the node's warm runner
  (``python -m agent.runner --warm``): started when the policy says so, it
  imports torch elastic and starts its zygote at once, then waits on stdin;
  :meth:`WarmRunner.take` writes a job's spec path to it, and its log file is
  renamed into the job's directory;
* :func:`runner_env` is both's environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.node.settings import AgentSettings
from agent.node.warm_policy import WarmState, WarmStep, WarmTimer, warm_step
from agent.spec import RunnerSpec
from agent.workers.logcap import open_private_log
from agent.workers.user import ENV_WORKER_USER
from agent.workers.zygote import TITLE_ROOM
from checkpoints.protocol import env as worker_env
from rendezvous.etcd.settings import ETCD_PASSWORD

log = logging.getLogger(__name__)

#: A runner process as the daemon holds it.
Process = subprocess.Popen[bytes]


def runner_env(settings: AgentSettings, job_id: str | None) -> dict[str, str]:
    """The runner's environment: marks it as this node's and job's; carries the
    etcd password, which the spec file (JSON, on disk) never holds."""
    env = dict(os.environ)
    env[worker_env.NODE_ID] = settings.node_id
    if job_id is not None:
        env[worker_env.JOB_ID] = job_id
    if settings.etcd_password is not None:
        env[ETCD_PASSWORD] = settings.etcd_password.get_secret_value()
    if settings.worker_user is not None:
        env[ENV_WORKER_USER] = settings.worker_user
    return env


def write_spec(spec: RunnerSpec, path: Path) -> None:
    """Write ``spec`` to ``path``, readable by the agent's user only."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(spec.model_dump_json())  # it may hold etcd credentials and job secrets


def start_cold(settings: AgentSettings, job_id: str, spec_path: Path, log_path: Path) -> Process:
    """Start a runner for the spec at ``spec_path``, its output into ``log_path``."""
    with open_private_log(log_path) as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "agent.runner", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Marks the runner (and so its workers) as this node's and this job's.
            env=runner_env(settings, job_id),
        )


@dataclass
class _Warm:
    process: Process
    log_path: Path


class WarmRunner:
    """The node's warm runner, started, handed over and discarded; main thread only.

    Args:
        settings: the agent's settings (its run directory, the runner's environment).
        clock: monotonic seconds (injected by tests).
    """

    def __init__(
        self, settings: AgentSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.timer = WarmTimer()
        self._warm: _Warm | None = None
        self._started = 0

    def _state(self) -> WarmState:
        if self._warm is None:
            return WarmState.NONE
        return WarmState.WAITING if self._warm.process.poll() is None else WarmState.EXITED

    def keep(self, *, wanted: bool, stopping: bool) -> None:
        """Start one if there is none, one is ``wanted`` and it is time; forget one that
        exited on its own (:func:`agent.node.warm_policy.warm_step`)."""
        now = self.clock()
        step = warm_step(self._state(), now=now, timer=self.timer, wanted=wanted,
                         stopping=stopping)
        if step == WarmStep.FORGET:
            assert self._warm is not None
            warm, self._warm = self._warm, None
            log.warning("warm runner %d exited with %d (log: %s); next one in %.0f s",
                        warm.process.pid, warm.process.returncode, warm.log_path,
                        self.timer.retry_s)
            self.timer = self.timer.died(now)
        elif step == WarmStep.SPAWN:
            self._spawn()

    def _spawn(self) -> None:
        warm_dir = self.settings.run_dir / "warm"
        warm_dir.mkdir(parents=True, exist_ok=True)
        self._started += 1
        log_path = warm_dir / f"runner-{os.getpid()}-{self._started}.log"
        with open_private_log(log_path) as log_file:
            process = subprocess.Popen(
                # TITLE_ROOM: room for the title it takes with a job (see runner_main).
                [sys.executable, "-m", "agent.runner", "--warm", TITLE_ROOM],
                stdin=subprocess.PIPE,  # the spec's path, or end-of-file to discard it
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**runner_env(self.settings, None), "SPT_NOENV": "1"},
            )
        self._warm = _Warm(process, log_path)
        log.info("warm runner %d started for the next job", process.pid)

    def successor_wanted(self) -> None:
        """A runner is stopped for its job's next generation: the next may start at once."""
        self.timer = self.timer.successor_wanted()

    def take(self, job_id: str, spec_path: Path, log_path: Path) -> tuple[Process, Path] | None:
        """Hand ``spec_path`` to the warm runner, if one is alive; it becomes the job's.

        Returns it and its log: ``log_path``, or beside it ``runner-<pid>.log``
        where that is taken (by the runner it replaces); None if there is none.
        """
        warm, self._warm = self._warm, None
        if warm is None:
            return None
        handed = self._hand(warm, job_id, spec_path, log_path)
        self.timer = self.timer.taken(self.clock(), handed=handed is not None)
        return handed

    @staticmethod
    def _hand(warm: _Warm, job_id: str, spec_path: Path,
              log_path: Path) -> tuple[Process, Path] | None:
        if warm.process.poll() is not None:
            log.warning("warm runner %d had exited with %d (log: %s)",
                        warm.process.pid, warm.process.returncode, warm.log_path)
            return None
        # Its output (and its zygote's) goes on into the same file, now the job's.
        if log_path.exists():
            log_path = log_path.with_name(f"runner-{warm.process.pid}.log")
        warm.log_path.rename(log_path)
        assert warm.process.stdin is not None
        try:
            warm.process.stdin.write(f"{spec_path}\n".encode())
            warm.process.stdin.close()
        except OSError as exc:  # it died just now: start a cold one instead
            log.warning("warm runner %d is gone (%s)", warm.process.pid, exc)
            with contextlib.suppress(ProcessLookupError):
                warm.process.kill()
            warm.process.wait()
            return None
        log.info("warm runner %d takes job %s (log: %s)", warm.process.pid, job_id, log_path)
        return warm.process, log_path

    def discard(self) -> None:
        """Stop the warm runner: end-of-file on its stdin, SIGKILL if it lingers."""
        warm, self._warm = self._warm, None
        if warm is None:
            return
        assert warm.process.stdin is not None
        with contextlib.suppress(OSError):
            warm.process.stdin.close()
        try:
            warm.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            warm.process.kill()
            warm.process.wait()
        with contextlib.suppress(OSError):
            warm.log_path.unlink()
