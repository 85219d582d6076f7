"""The JSON records the coordinator and the agents exchange through etcd.

``agent`` and ``service`` never import each other: they meet only through the
keys of :mod:`rendezvous.keys`, holding these pydantic models (JSON, never
pickle). Each model validates what it reads, so a malformed record is an error
naming the field, not a crash three calls later.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timezone
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from rendezvous.keys import validate_id

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_ARGV = 256
MAX_ARG_LEN = 4096
MAX_ENV = 128
MAX_ENV_VALUE_LEN = 8192
#: A dotted Python module name as ``import`` takes it: ASCII identifiers joined
#: by dots. agent.workers.zygote, which must start without pydantic, checks the
#: names it is given against the same pattern (a test keeps the two equal).
MODULE_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
_MODULE_NAME_RE = re.compile(MODULE_NAME_PATTERN)
MAX_PRELOAD = 32
MAX_MODULE_NAME_LEN = 200


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def check_command(value: list[str]) -> list[str]:
    """An argument vector: every argument bounded and free of NUL bytes.

    Raises:
        ValueError: naming the argument's index.
    """
    for i, arg in enumerate(value):
        if len(arg) > MAX_ARG_LEN or "\0" in arg:
            raise ValueError(f"command[{i}] is longer than {MAX_ARG_LEN} or holds a NUL byte")
    return value


def check_env(value: dict[str, str], *, reserved: Callable[[str], bool] = lambda _: False) -> (
    dict[str, str]
):
    """Environment variables: valid names, bounded values without NUL bytes, none reserved.

    Raises:
        ValueError: naming the variable (never its value: it may be a secret).
    """
    if len(value) > MAX_ENV:
        raise ValueError(f"env has {len(value)} variables; at most {MAX_ENV} are allowed")
    for name, text in value.items():
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"env variable name {name!r} is not a valid name")
        if reserved(name):
            raise ValueError(f"env variable {name} is set by tidal and cannot be given")
        if len(text) > MAX_ENV_VALUE_LEN or "\0" in text:
            raise ValueError(f"env variable {name} is too long or holds a NUL byte")
    return value


def check_module_names(value: list[str]) -> list[str]:
    """Modules a job's zygote preloads: dotted Python module names, bounded, none twice.

    Raises:
        ValueError: naming the entry (``zygote_preload[i]``) and its value.
    """
    if len(value) > MAX_PRELOAD:
        raise ValueError(
            f"zygote_preload has {len(value)} modules; at most {MAX_PRELOAD} are allowed"
        )
    seen: set[str] = set()
    for i, name in enumerate(value):
        if len(name) > MAX_MODULE_NAME_LEN:
            raise ValueError(
                f"zygote_preload[{i}] ({name[:40]!r}...) is {len(name)} characters long; "
                f"at most {MAX_MODULE_NAME_LEN} are allowed"
            )
        if not _MODULE_NAME_RE.fullmatch(name):
            raise ValueError(
                f"zygote_preload[{i}] ({name!r}) is not a dotted Python module name "
                "(identifiers of letters, digits and '_' joined by dots, e.g. 'transformers')"
            )
        if name in seen:
            raise ValueError(f"zygote_preload[{i}] ({name!r}) is given twice")
        seen.add(name)
    return value


#: A job's ``zygote_preload`` (service.api.models.JobSpec, Assignment).
ModuleNames = Annotated[
    list[str],
    AfterValidator(check_module_names),
    Field(
        max_length=MAX_PRELOAD,
        json_schema_extra={
            "items": {"type": "string", "pattern": MODULE_NAME_PATTERN,
                      "maxLength": MAX_MODULE_NAME_LEN},
            "uniqueItems": True,
        },
    ),
]


class Assignment(BaseModel):
    """What a node must run for one job: written by the coordinator at
    ``assignments/<node>/<job>``, read by that node's agent.

    ``generation`` changes whenever the coordinator wants the job restarted on
    this node; an agent never reruns a generation that already finished here.
    New bounds (``min_nodes``/``max_nodes``) are written into the assignment in
    place, at its generation: the running runner follows them (agent.bounds).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    generation: int = Field(default=1, ge=1)
    command: list[str] = Field(min_length=1, max_length=MAX_ARGV)
    cwd: str | None = Field(default=None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    min_nodes: int = Field(ge=1, le=10_000)
    max_nodes: int = Field(ge=1, le=10_000)
    nproc_per_node: int = Field(default=1, ge=1, le=1024)
    # GPUs the job's workers on this node get; the agent picks which (agent.gpu.devices).
    gpus_per_node: int = Field(default=0, ge=0, le=1024)
    max_restarts: int = Field(default=3, ge=0, le=10_000)
    checkpoint_dir: str | None = Field(default=None, max_length=4096)
    rdzv_conf: dict[str, str] = Field(default_factory=dict)
    grace_period_s: float = Field(default=30.0, gt=0, le=3600)
    # Modules the job's zygote imports after torch (the runner puts them in
    # TIDAL_ZYGOTE_PRELOAD; a job's own environment cannot set TIDAL_*). Left out of
    # the record when empty, so that an agent from before the field (which refuses
    # unknown fields) still takes the jobs that do not use it.
    zygote_preload: ModuleNames = Field(default_factory=list, exclude_if=lambda v: not v)

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, value: str) -> str:
        return validate_id(value, what="job id")

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        return check_command(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @model_validator(mode="after")
    def _min_le_max(self) -> Assignment:
        if self.min_nodes > self.max_nodes:
            raise ValueError(
                f"min_nodes ({self.min_nodes}) is greater than max_nodes ({self.max_nodes})"
            )
        return self


class JobNodeState(str, Enum):
    """What a node's agent is doing for a job."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_terminal(self) -> bool:
        return self in (JobNodeState.SUCCEEDED, JobNodeState.FAILED, JobNodeState.CANCELLED)


class RestartReason(str, Enum):
    WORKER_FAILED = "worker_failed"
    NODE_LOST = "node_lost"
    NODE_JOINED = "node_joined"
    MEMBERSHIP_CHANGED = "membership_changed"


#: ``WorkerError.rank`` of a failure that is the node's runner's (it could not
#: start the job, raised or was killed), not a worker's.
RUNNER_RANK = -1


class WorkerError(BaseModel):
    """The root cause of a worker group failure (``rank`` is ``RUNNER_RANK``
    when the node's runner failed rather than a worker)."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    exit_code: int
    signal: str | None = None
    message: str = Field(default="", max_length=4096)
    traceback: str = Field(default="", max_length=65536)


class JobNodeStatus(BaseModel):
    """What one node's agent reports for one job, at ``status/<job>/<node>``."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    node_id: str
    generation: int = 1
    state: JobNodeState
    world_size: int = 0
    ranks: list[int] = Field(default_factory=list)
    # The GPU indices (NVML's) the node's workers hold for the job; [] without GPUs.
    devices: list[int] = Field(default_factory=list, max_length=1024)
    restart_count: int = 0
    restart_reasons: dict[str, int] = Field(default_factory=dict)
    last_restart_reason: RestartReason | None = None
    remaining_restarts: int = 0
    last_step: int | None = None
    last_checkpoint_step: int | None = None
    # What the workers last reported (agent.progress.ProgressSummary), for people following
    # the job: the global samples/s as one rank measures it, the mean loss of this node's
    # ranks, when the newest checkpoint was written (Unix time) and the total steps.
    samples_per_second: float | None = None
    loss: float | None = None
    last_checkpoint_time: float | None = None
    total_steps: int | None = Field(default=None, ge=0)
    # The node's own pace in its recent steps, [step, seconds] oldest first: at each step its
    # slowest rank's time computing, not waiting (checkpoints.pace, agent.progress.node_paces).
    # The coordinator compares the nodes of a job with it (service.scheduler.stragglers).
    paces: list[tuple[int, float]] = Field(default_factory=list, max_length=64)
    # Seconds from the last failure or membership change this node noticed to
    # the first step of the workers it then started (agent.runner.status).
    last_recovery_seconds: float | None = Field(default=None, ge=0)
    # Which path this node's membership changes took (agent.runner.live_decide): "live" (the
    # workers re-formed their group in place) or "restart" (stopped and started
    # again from the newest state), counted by path; the last one, with the
    # fallback's cause: "live", "restart", "restart (timeout)".
    resize_paths: dict[str, int] = Field(default_factory=dict, max_length=4)
    last_resize: str | None = Field(default=None, max_length=64)
    # Goodput on this node (agent.runner.status, docs/checkpoints.md): seconds its workers
    # trained productively in this generation, and seconds lost, by cause.
    productive_seconds: float | None = Field(default=None, ge=0)
    lost_seconds: dict[str, float] = Field(default_factory=dict, max_length=16)
    error: WorkerError | None = None
    pid: int = 0
    updated_at: datetime = Field(default_factory=utcnow)
