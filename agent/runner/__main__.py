"""The job runner's entry point: ``python -m agent.runner SPEC.json | --warm``.

It does what needs no torch first, the working directory, the environment
and the start of the job's zygote (:mod:`agent.workers.zygote`), and only then
imports :mod:`agent.runner.elastic` (torch elastic, about 1.5 s), so that the
zygote's imports and the runner's overlap.

With ``--warm`` it is started by the daemon before any job is assigned (a
*warm runner*): it starts its zygote and imports torch elastic at once, then
waits for the path of its spec on stdin. A node that has been up a few
seconds so starts a job's workers without paying for ``python`` and
``import torch`` again. The zygote imported torch with the daemon's
environment, so a job that sets an import-time variable (``PYTHONPATH``,
``LD_PRELOAD``, ``TORCH_*``, ...; see :func:`import_time_differences`),
or names modules for its zygote to preload (``zygote_preload``, which
:func:`prepare_environment` puts in ``TIDAL_ZYGOTE_PRELOAD``), gets a new
zygote started with its own.

The working and checkpoint directories are checked here, right before use
(:mod:`agent.workers.jobpaths`): a job whose directory is missing, is a file or has
become a symlink fails at once with that reason in its status. Any other
error of the runner itself ends it with :data:`~agent.spec.EXIT_CRASHED` and
an outcome file, and the daemon decides (:mod:`agent.node.supervise`).

A bare ``python`` or ``python3`` as the command's first word means this
runner's own interpreter (:func:`agent.spec.job_command`), the one tidal is installed
in, whatever ``python`` is on the node's ``PATH``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from agent import rundir
from agent.workers.jobpaths import JobSetupError, check_directory, enter_directory
from agent.workers.lifeline import die_with_parent
from agent.workers.user import ENV_WORKER_USER, pin_worker_user
from agent.workers.zygote import ENV_SOCKET, ENV_SWITCH, ZygoteProcess
from checkpoints.protocol import env as worker_env
from checkpoints.protocol.progress import is_report_name
from rendezvous.etcd.settings import ETCD_PASSWORD

if TYPE_CHECKING:
    from agent.spec import RunnerSpec

def prepare_environment(spec: RunnerSpec) -> Path:
    """Working directory and environment the workers inherit; returns the progress dir.

    Raises:
        JobSetupError: the working or checkpoint directory is missing, a file,
            or reached through a symlink (:mod:`agent.workers.jobpaths`).
    """
    from agent.runner.netif import socket_interface_env
    from checkpoints.protocol.env import device_env

    job = spec.assignment
    progress_dir = rundir.progress_dir(spec.job_dir)
    progress_dir.mkdir(parents=True, exist_ok=True)
    if spec.prior is not None:
        # This runner replaces one that died: its workers' progress files (a
        # higher restart count than ours will have) would hide our workers'.
        for stale in progress_dir.glob("*"):
            if is_report_name(stale.name):
                stale.unlink(missing_ok=True)
    if job.cwd:
        enter_directory(job.cwd, what="working directory")
    if job.checkpoint_dir:
        check_directory(job.checkpoint_dir, what="checkpoint directory")
    worker_user = os.environ.get(ENV_WORKER_USER)  # the agent's: no job may change it
    os.environ.update(job.env)
    pin_worker_user(worker_user)
    if job.zygote_preload:  # the job spec's list: a job's env cannot set TIDAL_*
        os.environ[worker_env.ZYGOTE_PRELOAD] = ",".join(job.zygote_preload)
    os.environ.update(
        {
            worker_env.JOB_ID: job.job_id,
            worker_env.NODE_ID: spec.node_id,
            worker_env.PROGRESS_DIR: str(progress_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if job.checkpoint_dir:
        os.environ[worker_env.CHECKPOINT_DIR] = job.checkpoint_dir
    # Collectives go over the interface other nodes reach this one at.
    os.environ.update(socket_interface_env(spec.address, job.env))
    # The job's own GPUs, numbered as NVML numbers them (rendezvous.gpus).
    os.environ.update(device_env(spec.devices))
    return progress_dir


#: Variables that shape what ``import torch`` sets up (library paths, the
#: import path, allocator and threading runtimes, the zygote's own switches).
#: A warm runner's zygote imported torch before the job's environment was
#: known; if the job sets any of these differently, a new zygote starts with it.
_IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA_",
    "MALLOC_",
    worker_env.ZYGOTE,  # and every TIDAL_ZYGOTE_* switch
)
#: ... except these, which a forked worker applies itself or which torch reads later.
_APPLIED_AFTER_FORK = frozenset(
    {"PYTHONUNBUFFERED", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
     worker_env.ZYGOTE_SOCKET}
)


def import_time_differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Names of import-time variables that differ between two environments."""
    return sorted(
        name
        for name in before.keys() | after.keys()
        if name.startswith(_IMPORT_TIME_PREFIXES)
        and name not in _APPLIED_AFTER_FORK
        and before.get(name) != after.get(name)
    )


def take_password() -> str | None:
    """The etcd password, out of the environment that workers and the zygote inherit.

    It comes through the environment, never the spec file (JSON, on disk).
    """
    return os.environ.pop(ETCD_PASSWORD, None)


def load_spec(path: Path, password: str | None) -> RunnerSpec:
    """The daemon's spec, with the etcd password."""
    from pydantic import SecretStr

    from agent.spec import RunnerSpec

    spec = RunnerSpec.model_validate_json(path.read_text())
    return spec.model_copy(
        update={
            "etcd": spec.etcd.model_copy(
                update={"password": SecretStr(password) if password else None}
            )
        }
    )


def _configure_logging(job_id: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s runner[{job_id}] %(name)s: %(message)s",
        force=True,
    )


def _start_zygote() -> ZygoteProcess:
    zygote = ZygoteProcess(os.getpid())  # imports torch beside us
    os.environ[ENV_SOCKET] = zygote.path
    return zygote


def _run(spec: RunnerSpec, progress_dir: Path, zygote: ZygoteProcess | None) -> int:
    from agent.runner.elastic import run  # torch: about 1.5 s

    return run(spec, progress_dir=progress_dir, zygote=zygote)


def report_setup_failure(spec: RunnerSpec, exc: JobSetupError) -> None:
    """Write the job's status FAILED here with ``exc`` as its root cause.

    If etcd cannot be reached, the outcome file (written first) lets the
    daemon report it instead.
    """
    from agent.spec import EXIT_FAILED, RunnerOutcome, write_outcome
    from rendezvous.errors import EtcdError
    from rendezvous.etcd import create_client
    from rendezvous.records import RUNNER_RANK, JobNodeState, JobNodeStatus, WorkerError, utcnow

    job = spec.assignment
    with _logged_oserror("the outcome file"):
        write_outcome(spec.job_dir, RunnerOutcome(pid=os.getpid(), message=str(exc)))
    base = spec.prior or JobNodeStatus(
        job_id=job.job_id, node_id=spec.node_id, generation=job.generation,
        state=JobNodeState.STARTING, remaining_restarts=job.max_restarts,
    )
    status = base.model_copy(update={
        "state": JobNodeState.FAILED,
        "error": WorkerError(rank=RUNNER_RANK, exit_code=EXIT_FAILED, message=str(exc)[-4000:]),
        "world_size": 0, "ranks": [], "pid": os.getpid(), "updated_at": utcnow(),
    })
    try:
        client = create_client(spec.etcd)
        try:
            client.put(client.keys.status(job.job_id, spec.node_id),
                       status.model_dump_json().encode())
        finally:
            client.close()
    except EtcdError as exc_etcd:
        logging.getLogger("tidal.runner").error(
            "could not report the failure to etcd (the agent will): %s", exc_etcd)


@contextlib.contextmanager
def _logged_oserror(what: str) -> Iterator[None]:
    """Log an OSError of the block instead of raising it: the exit code still tells."""
    try:
        yield
    except OSError as exc:
        logging.getLogger("tidal.runner").warning("could not write %s: %s", what, exc)


def guarded(spec: RunnerSpec, body: Callable[[], int]) -> int:
    """Run ``body``; turn its errors into an exit code the daemon understands.

    A :class:`JobSetupError` fails the job here (status FAILED, with the
    reason): retrying cannot help. Any other exception is the runner's own
    failure: an outcome file with the traceback and
    :data:`~agent.spec.EXIT_CRASHED`, which the daemon charges to the job's
    restart budget (:mod:`agent.node.supervise`).
    """
    from agent.spec import EXIT_CRASHED, EXIT_FAILED, RunnerOutcome, write_outcome

    log = logging.getLogger("tidal.runner")
    try:
        return body()
    except JobSetupError as exc:
        log.error("the job cannot start on this node: %s", exc)
        report_setup_failure(spec, exc)
        return EXIT_FAILED
    except Exception as exc:
        log.exception("the runner failed")
        with _logged_oserror("the outcome file"):
            write_outcome(spec.job_dir, RunnerOutcome(
                pid=os.getpid(), message=f"{type(exc).__name__}: {exc}".strip()[-4000:],
                traceback=traceback.format_exc()[-60000:],
            ))
        return EXIT_CRASHED


def main(argv: list[str]) -> int:
    # ``kill -USR1 RUNNER`` writes every thread's stack into its log (stderr): where a
    # runner that hangs waits (the churn benchmark's watchdog asks for it).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if argv[:1] == ["--warm"] and len(argv) <= 2:  # [TITLE_ROOM]
        return warm_main()
    if len(argv) != 1:
        sys.stderr.write("usage: python -m agent.runner SPEC.json | --warm [TITLE_ROOM]\n")
        return 2
    spec = load_spec(Path(argv[0]), take_password())
    die_with_parent(expected_parent=spec.parent_pid)
    _configure_logging(spec.assignment.job_id)
    return guarded(spec, lambda: _cold(spec))


def _cold(spec: RunnerSpec) -> int:
    progress_dir = prepare_environment(spec)
    zygote = None if spec.assignment.env.get(ENV_SWITCH) == "0" else _start_zygote()
    try:
        return _run(spec, progress_dir, zygote)
    finally:
        if zygote is not None:
            zygote.close()


def warm_main() -> int:
    """A runner started before its job is known (see agent.node.daemon, warm runners).

    It starts its zygote and imports torch elastic at once, then reads the
    path of its spec from stdin: the daemon writes it when a job is assigned
    to the node, or closes stdin to discard the runner. Until then it costs
    memory, not CPU.
    """
    die_with_parent(expected_parent=os.getppid())
    _configure_logging("warm")
    password = take_password()  # before the zygote starts: no worker may see it
    zygote = None if os.environ.get(ENV_SWITCH) == "0" else _start_zygote()
    zygote_env = dict(os.environ)
    try:
        import agent.runner.elastic  # noqa: F401  # torch: about 1.5 s, while no job waits

        log = logging.getLogger("tidal.runner")
        log.info("warm runner %d ready for a job", os.getpid())
        line = sys.stdin.readline().strip()
        if not line:
            return 0  # discarded
        spec = load_spec(Path(line), password)
        if spec.parent_pid != os.getppid():  # the daemon that started us hands us the job
            sys.stderr.write(f"spec {line} is for a runner of process {spec.parent_pid}\n")
            return 2
        _configure_logging(spec.assignment.job_id)
        log.info(
            "warm runner %d takes job %s (generation %d)",
            os.getpid(),
            spec.assignment.job_id,
            spec.assignment.generation,
        )
        _retitle(f"{sys.executable} -m agent.runner {line}")

        def take(spec: RunnerSpec = spec) -> int:
            nonlocal zygote
            progress_dir = prepare_environment(spec)
            if zygote is not None and spec.assignment.env.get(ENV_SWITCH) == "0":
                zygote.close()
                zygote = None
                os.environ.pop(ENV_SOCKET, None)
            elif zygote is not None and (
                changed := import_time_differences(zygote_env, dict(os.environ))
            ):
                log.info("the job sets %s: starting a zygote with its environment",
                         ", ".join(changed))
                zygote.close()
                zygote = _start_zygote()
            return _run(spec, progress_dir, zygote)

        return guarded(spec, take)
    finally:
        if zygote is not None:
            zygote.close()


def _retitle(title: str) -> None:
    """Make ``ps`` show what a runner started for this job would show.

    The daemon started us with ``SPT_NOENV`` and room in our arguments, so
    the title fits there and ``/proc/PID/environ`` is left alone.
    """
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)
    os.environ.pop("SPT_NOENV", None)  # not for the workers


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
