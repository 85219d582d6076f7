"""What the daemon hands a job runner, and what the runner hands back.

The daemon writes a :class:`RunnerSpec`; the runner answers with its exit
code and, when it ends on an error, a :class:`RunnerOutcome` file beside its
log (the daemon never reads the log as a protocol). Kept apart from
:mod:`agent.runner.elastic` so that the daemon, which only starts runners, never
imports torch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.workers.logcap import DEFAULT_MAX_BYTES
from rendezvous.etcd import EtcdConfig
from rendezvous.records import Assignment, JobNodeStatus

log = logging.getLogger(__name__)

EXIT_SUCCEEDED = 0
#: The job failed here and the runner reported it (status FAILED): the budget
#: is spent, or the job cannot start on this node (a missing working directory).
EXIT_FAILED = 1
EXIT_STOPPED = 3  # stopped on request (SIGTERM): the node left the job
#: The runner itself broke (an unexpected exception); its outcome file says how.
#: The daemon charges a restart or fails the job (agent.node.supervise).
EXIT_CRASHED = 4

#: Command words that mean "the interpreter tidal runs in" (see :func:`job_command`).
BARE_PYTHON = frozenset({"python", "python3"})


def job_command(command: list[str], python: str) -> list[str]:
    """The job's command with a bare ``python``/``python3`` first word made ``python``.

    Workers would otherwise run whatever ``python`` the node's ``PATH`` finds,
    usually not the environment tidal and torch are installed in. A path
    (``/usr/bin/python3``, ``./venv/bin/python``) or another name
    (``python3.12``, ``env python``) is left as the job wrote it.
    """
    if command and command[0] in BARE_PYTHON:
        return [python, *command[1:]]
    return list(command)


#: The runner's :class:`RunnerOutcome`, in its job directory.
OUTCOME_FILE = "runner-outcome.json"


class RunnerSpec(BaseModel):
    """Everything a runner needs, written by the daemon as JSON next to the job's logs."""

    model_config = ConfigDict(extra="forbid")

    assignment: Assignment
    node_id: str
    address: str
    etcd: EtcdConfig
    job_dir: Path
    parent_pid: int
    log_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1024)
    # The TTL of the runner's rendezvous record: how long a hung or cut-off
    # node holds up the job's other nodes.
    lease_ttl_s: int = Field(default=5, ge=2, le=300)
    # Set when this runner replaces one of the same generation that died
    # without saying how its job ended: that runner's last status, with the
    # daemon's charge for its death. The new runner goes on from it (restart
    # counts, the remaining budget).
    prior: JobNodeStatus | None = None
    # The GPU indices the job's workers get here (CUDA_VISIBLE_DEVICES); None
    # on a node without GPUs, [] for a job that asked for none on a GPU node.
    devices: list[int] | None = None


class RunnerOutcome(BaseModel):
    """Why a runner ended on an error: written by the runner, read by the daemon."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    message: str = Field(max_length=4096)
    traceback: str = Field(default="", max_length=65536)


def write_outcome(job_dir: Path, outcome: RunnerOutcome) -> None:
    """Replace the outcome file in ``job_dir`` (through a rename: never read half-written)."""
    path = job_dir / OUTCOME_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(outcome.model_dump_json())
    os.replace(tmp, path)


def read_outcome(job_dir: Path, pid: int) -> RunnerOutcome | None:
    """What the runner ``pid`` wrote in ``job_dir``; None if nothing, another's or unreadable."""
    try:
        outcome = RunnerOutcome.model_validate_json((job_dir / OUTCOME_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.warning("ignoring the unreadable %s in %s: %s", OUTCOME_FILE, job_dir, exc)
        return None
    return outcome if outcome.pid == pid else None
