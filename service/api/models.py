"""The coordinator's data: what a user submits, what etcd holds, what the API answers.

* :class:`JobSpec` is what ``POST /v1/jobs`` accepts. Every field has limits
  (counts, lengths, charset of names) and a strict type (``"2"`` or ``true`` is
  not a number), so any input is either valid or a 422 naming the field; it can
  never become a 500. :func:`check_storable` bounds the spec's total size at
  submit, so that its record and each of its assignments always fit one etcd
  request (see :data:`MAX_SPEC_BYTES`).
* :class:`JobRecord` is what ``jobs/<id>`` holds in etcd: the spec (with the
  user's later min/max changes), the desired state, the phase and its
  conditions. Only the coordinator writes it, JSON validated by pydantic.
* :class:`JobView` is what ``GET /v1/jobs/{id}`` answers: the record joined
  with what the agents report and where the job runs.

The job lifecycle (:class:`JobPhase`) is a ``str`` enum with its transitions
written down; leaving a terminal phase raises :class:`IllegalTransitionError`.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from enum import Enum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from checkpoints.protocol import env as worker_env
from rendezvous.gpus import GpuInfo
from rendezvous.records import (
    MAX_ARG_LEN,
    MAX_ARGV,
    MAX_ENV_VALUE_LEN,
    ModuleNames,
    WorkerError,
    check_command,
    check_env,
    utcnow,
)
from service.api.queues import DEFAULT_QUEUE, QueueName

# A job's name is a label people read and part of its id: letters, digits,
# '.', '_' and '-', starting with a letter or digit.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,39}$"
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"
MAX_NODES = 10_000
# Total sizes a submitted spec may reach. etcd refuses a request over 1.5 MiB
# (--max-request-bytes); the reconciler writes a job's record and each of its
# assignments (each carrying the command and environment) in transactions of
# at most service.coordinator.store.MAX_TXN_BYTES (1 MiB), so one record or assignment must
# stay well under that, with room for the record's node map (up to
# MAX_NODES entries) and the resize policy's variables.
#: The environment's names and values together, in UTF-8 bytes.
MAX_ENV_BYTES = 128 * 1024
#: The command's arguments together, in UTF-8 bytes.
MAX_COMMAND_BYTES = 128 * 1024
#: The whole spec as JSON, in bytes.
MAX_SPEC_BYTES = 256 * 1024
#: Environment variable names reserved for what tidal itself tells the workers.
RESERVED_ENV_PREFIXES = (worker_env.RESERVED_PREFIX, "TORCHELASTIC_")
RESERVED_ENV = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
     "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"}
)

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
LabelKey = Annotated[str, StringConstraints(pattern=LABEL_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=r"^[A-Za-z0-9._/-]*$")]
RelPath = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class IllegalTransitionError(ValueError):
    """A job was asked to move between phases that its lifecycle does not connect."""


class JobPhase(str, Enum):
    """Where a job is in its life.

    ``PENDING`` (fewer usable nodes than its minimum) -> ``RUNNING`` ->
    ``RESCALING`` (membership changed; restarting from a checkpoint) ->
    ``RUNNING`` ... -> ``SUCCEEDED`` | ``FAILED`` | ``CANCELLED``.
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RESCALING = "RESCALING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED)

    def check_transition(self, to: JobPhase) -> None:
        """Raise :class:`IllegalTransitionError` unless ``self -> to`` is allowed."""
        if to not in TRANSITIONS[self]:
            raise IllegalTransitionError(f"a job cannot go from {self.value} to {to.value}")


_TERMINAL = {JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED}
TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.PENDING: frozenset({JobPhase.RUNNING, JobPhase.RESCALING, *_TERMINAL}),
    JobPhase.RUNNING: frozenset({JobPhase.RESCALING, JobPhase.PENDING, *_TERMINAL}),
    JobPhase.RESCALING: frozenset({JobPhase.RUNNING, JobPhase.PENDING, *_TERMINAL}),
    JobPhase.SUCCEEDED: frozenset(),
    JobPhase.FAILED: frozenset(),
    JobPhase.CANCELLED: frozenset(),
}


class ExitReason(str, Enum):
    """Why a job ended."""

    SUCCEEDED = "succeeded"
    WORKER_FAILED = "worker_failed"  # a worker failed and the restart budget was spent
    CANCELLED = "cancelled"
    # etcd kept refusing the job's writes (e.g. a request over its size limit)
    UNSCHEDULABLE = "unschedulable"


class EventReason(str, Enum):
    """Why something happened to a job: every phase change and resize has one."""

    SUBMITTED = "submitted"
    SCHEDULED = "scheduled"
    NODE_JOINED = "node_joined"
    NODE_LOST = "node_lost"
    NODE_DRAINED = "node_drained"
    SCALED_BY_USER = "scaled_by_user"
    BELOW_MIN_NODES = "below_min_nodes"
    RESTARTED = "restarted"
    WORKER_FAILED = "worker_failed"
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    WRITE_FAILED = "write_failed"  # etcd refused the job's change; see ExitReason.UNSCHEDULABLE
    TRAINING_STARTED = "training_started"  # a worker of the current generation reported a step
    WAITING_FOR_FIRST_STEP = "waiting_for_first_step"
    # a worker or the runner failed on a node and a restart was charged to its budget
    RESTART_CHARGED = "restart_charged"
    # the scheduler took slots back for another job (service.api.queues): shrunk toward
    # its minimum (a graceful resize), or stopped whole and back to PENDING
    RECLAIMED = "reclaimed"
    PREEMPTED = "preempted"
    # which way a membership change went on the nodes that stayed (agent.runner.live_decide): their
    # workers re-formed the process group in place, or were restarted from the newest state
    RESIZED_LIVE = "resized_live"
    RESIZED_BY_RESTART = "resized_by_restart"
    # a running job's membership changed: RESCALING until every node runs at the new
    # size, by whichever path (its RUNNING event says resized_live or restarted)
    RESIZING = "resizing"
    # a node of the job was slower than the others (service.scheduler.stragglers): drained
    # from the job by the live path, or only reported (policy report, or at min_nodes)
    STRAGGLER_EVICTED = "straggler_evicted"
    STRAGGLER_REPORTED = "straggler_reported"


ConditionType = Literal["Scheduled", "Running", "Training", "Finished"]


class ResizePolicy(BaseModel):
    """How a job keeps its learning dynamics when its world size changes.

    Reaches the workers through their environment (``TIDAL_GLOBAL_BATCH_SIZE``,
    ``TIDAL_RESIZE_POLICY``), where the checkpoints library applies it.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    global_batch_size: int | None = Field(
        default=None, ge=1, le=1 << 24,
        description="Samples per step over all workers, kept fixed by gradient accumulation.",
    )
    lr_rule: Literal["none", "linear", "sqrt"] = Field(
        default="none",
        description="Scale the learning rate with the world size (for jobs whose global "
        "batch grows with it) by this rule instead.",
    )

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {worker_env.RESIZE_POLICY: self.lr_rule}
        if self.global_batch_size is not None:
            out[worker_env.GLOBAL_BATCH_SIZE] = str(self.global_batch_size)
        return out


class StragglerPolicy(BaseModel):
    """What the coordinator does about a node slower than the rest of its job.

    A node is a straggler when its pace (the time its ranks spend computing a
    step, not waiting for the others) is ``factor`` times the median of the
    job's other nodes or more, as the median over the last ``window_steps``
    steps: single spikes and noise do not count. ``evict`` drains it from the
    job by the live path (never below ``min_nodes``: there it is reported
    only); ``report`` only says so; ``off`` does not look.
    (:mod:`service.scheduler.stragglers` decides.)
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["off", "report", "evict"] = Field(
        default="report",
        description="off, report (events and metrics only) or evict. report by default: "
        "nodes that share a machine (or an oversubscribed CPU) can differ by more than the "
        "factor for reasons a drain would not fix, so evicting is the job's choice.")
    factor: float = Field(
        default=1.3, ge=1.05, le=10.0,
        description="How many times the median of the job's other nodes a node's step takes "
        "before it is a straggler.")
    window_steps: int = Field(
        default=20, ge=3, le=64,
        description="Over how many recent steps the node's pace is compared (the median; "
        "a node reports its last 64).")


class JobSpec(BaseModel):
    """A training job as a user submits it.

    Strict: a number given as a string (``"2"``) or a boolean is refused, not
    coerced.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name = Field(description="A readable name; the job id is the name plus a suffix.")
    command: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_ARG_LEN)]] = Field(
        min_length=1, max_length=MAX_ARGV,
        description="The argument list each worker runs (never a shell string).",
    )
    working_dir: RelPath | None = Field(
        default=None, description="Relative to the coordinator's workdir root."
    )
    env: dict[str, Annotated[str, StringConstraints(max_length=MAX_ENV_VALUE_LEN)]] = Field(
        default_factory=dict, description="Extra environment; values are never shown by the API."
    )
    min_nodes: int = Field(default=1, ge=1, le=MAX_NODES)
    max_nodes: int = Field(default=1, ge=1, le=MAX_NODES)
    nproc_per_node: int = Field(
        default=1, ge=1, le=1024,
        description="Worker processes per node; defaults to gpus_per_node when that is given.",
    )
    gpus_per_node: int = Field(
        default=0, ge=0, le=1024,
        description="GPUs each node gives the job (its workers see only those).",
    )
    checkpoint_dir: RelPath | None = Field(
        default=None, description="Relative to the coordinator's checkpoint root."
    )
    max_restarts: int = Field(default=3, ge=0, le=1000, description="Worker-failure budget.")
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Labels a node must carry."
    )
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="Higher is scheduled first within the job's queue.")
    queue: QueueName = Field(default=DEFAULT_QUEUE, description="The queue the job runs in.")
    resize_policy: ResizePolicy | None = None
    straggler_policy: StragglerPolicy = Field(
        default_factory=StragglerPolicy,
        description="What happens to a node that is persistently slower than the job's others.",
    )
    grace_period_s: float = Field(
        default=30.0, gt=0, le=3600, description="SIGTERM to SIGKILL when a node leaves the job."
    )
    zygote_preload: ModuleNames = Field(default_factory=list, description=(
        "Modules the job's zygote imports after torch (e.g. transformers), so that"
        " restarted and joining workers do not import them."))

    @model_validator(mode="before")
    @classmethod
    def _nproc_from_gpus(cls, data: object) -> object:
        """One worker per GPU unless nproc_per_node says otherwise."""
        if isinstance(data, dict) and "nproc_per_node" not in data:
            gpus = data.get("gpus_per_node")
            if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1:
                return {**data, "nproc_per_node": gpus}
        return data

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        return check_command(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value, reserved=is_reserved_env)

    @field_validator("working_dir", "checkpoint_dir")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_relative_path(value)
        return value

    @model_validator(mode="after")
    def _bounds(self) -> JobSpec:
        check_bounds(self.min_nodes, self.max_nodes)
        return self


def is_reserved_env(name: str) -> bool:
    """Whether tidal (or torch elastic) sets ``name`` for the workers itself."""
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_storable(spec: JobSpec) -> None:
    """Refuse a spec too large to be stored and scheduled (see :data:`MAX_SPEC_BYTES`).

    Raises:
        ValueError: naming the field, its size and the limit (never a value:
            the environment may hold secrets).
    """
    env = sum(_utf8_len(name) + _utf8_len(value) for name, value in spec.env.items())
    if env > MAX_ENV_BYTES:
        raise ValueError(
            f"env: the variables total {env} bytes; at most {MAX_ENV_BYTES} are allowed"
        )
    command = sum(_utf8_len(arg) for arg in spec.command)
    if command > MAX_COMMAND_BYTES:
        raise ValueError(
            f"command: the arguments total {command} bytes; "
            f"at most {MAX_COMMAND_BYTES} are allowed"
        )
    size = len(spec.model_dump_json())
    if size > MAX_SPEC_BYTES:
        raise ValueError(
            f"spec: the job spec is {size} bytes as JSON; at most {MAX_SPEC_BYTES} are allowed"
        )


def check_bounds(min_nodes: int, max_nodes: int) -> None:
    if min_nodes > max_nodes:
        raise ValueError(f"min_nodes ({min_nodes}) is greater than max_nodes ({max_nodes})")


def check_relative_path(value: str) -> None:
    """Refuse what could leave a configured root: absolute paths, ``..``, NUL, backslashes.

    Raises:
        ValueError: naming what is wrong with ``value``.
    """
    if "\0" in value:
        raise ValueError("path holds a NUL byte")
    if value.startswith(("/", "~")):
        raise ValueError(f"path {value!r} must be relative to the configured root")
    if "\\" in value:
        raise ValueError(f"path {value!r} holds a backslash")
    if any(part == ".." for part in value.split("/")):
        raise ValueError(f"path {value!r} must not contain '..'")


def new_job_id(name: str) -> str:
    """``name`` plus a random suffix: unique, readable, and a valid key component."""
    return f"{name}-{secrets.token_hex(4)}"


class Condition(BaseModel):
    """One observation about a job, in the style of Kubernetes' conditions.

    ``Scheduled``: the job holds its minimum of nodes. ``Running``: every node
    runs at the job's current size. ``Training``: a worker of the current
    generation reported a step (``Running`` turns true when the workers are up,
    ``Training`` once they made progress: after the import, the rendezvous and
    the checkpoint restore). ``Finished``: the job ended.
    """

    type: ConditionType
    status: bool
    reason: str
    message: str = ""
    last_transition_time: datetime


class ChargedRestarts(BaseModel):
    """The budget-charged restarts one node's status reported for its assignment's
    generation, as far as the coordinator folded them into the job's ``restarts``."""

    model_config = ConfigDict(extra="forbid")

    generation: int = Field(ge=1)
    worker_failed: int = Field(default=0, ge=0)


class SeenResizes(BaseModel):
    """The resize paths one node's status reported for its assignment's generation
    (``JobNodeStatus.resize_paths``), as far as the coordinator gave them events."""

    model_config = ConfigDict(extra="forbid")

    generation: int = Field(ge=1)
    paths: dict[str, int] = Field(default_factory=dict, max_length=4)


class JobRecord(BaseModel):
    """What etcd holds at ``jobs/<id>``. Written by the coordinator only.

    ``next_generation`` numbers the job's assignments: every assignment the
    coordinator writes gets a fresh one, so an agent never confuses a new
    assignment with one it already ran.

    ``restarts`` counts the job's restarts by reason over its whole life. The
    agents count the ``worker_failed`` ones in their status, per node and
    generation; ``charged`` says how many of those each node's current
    generation has already added to ``restarts``, so that every charged restart
    is counted (and given an event) once, whichever coordinator sees it and
    however often a node leaves and rejoins.
    """

    model_config = ConfigDict(extra="forbid")

    job_id: str
    spec: JobSpec
    cwd: str | None = None  # spec.working_dir resolved under the workdir root
    checkpoint_path: str | None = None  # spec.checkpoint_dir resolved under its root
    phase: JobPhase = JobPhase.PENDING
    cancel_requested: bool = False
    conditions: list[Condition] = Field(default_factory=list)
    exit_reason: ExitReason | None = None
    error: WorkerError | None = None
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    # When a worker first reported a step (the Training condition's first true),
    # once in the job's life: what "submit to first step" is measured against.
    first_step_at: datetime | None = None
    nodes: dict[str, int] = Field(
        default_factory=dict, description="node -> generation of its assignment (derived)"
    )
    next_generation: int = 1
    next_event: int = 0
    restarts: dict[str, int] = Field(default_factory=dict)
    charged: dict[str, ChargedRestarts] = Field(
        default_factory=dict, description="node -> restarts of its generation in `restarts`"
    )
    resized: dict[str, SeenResizes] = Field(
        default_factory=dict, description="node -> resize paths of its generation in events"
    )
    stragglers: dict[str, int] = Field(
        default_factory=dict,
        description="node -> generation of its assignment when it was reported a straggler "
        "(reported once per generation)",
    )

    def condition_differs(self, type_: str, status: bool, reason: str) -> bool:
        """Whether :meth:`set_condition` with these values would change anything."""
        return not any(
            c.type == type_ and c.status == status and c.reason == reason for c in self.conditions
        )

    def set_condition(
        self, type_: ConditionType, status: bool, reason: str,
        message: str = "", *, now: datetime | None = None,
    ) -> None:
        """Set a condition, keeping its transition time when its status is unchanged.

        ``now`` is the transition time (default: the wall clock). The scheduler
        passes the time it was given, so that the same view gives the same plan.
        """
        if not self.condition_differs(type_, status, reason):
            return
        now = utcnow() if now is None else now
        for i, cond in enumerate(self.conditions):
            if cond.type == type_:
                if cond.status == status and cond.reason == reason:
                    return
                when = cond.last_transition_time if cond.status == status else now
                self.conditions[i] = Condition(
                    type=type_, status=status, reason=reason, message=message,
                    last_transition_time=when,
                )
                return
        self.conditions.append(
            Condition(type=type_, status=status, reason=reason, message=message,
                      last_transition_time=now)
        )


class JobEvent(BaseModel):
    """One entry of a job's history, at ``events/<job>/<seq>``."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    time: datetime = Field(default_factory=utcnow)
    phase: JobPhase
    reason: EventReason
    message: str = Field(default="", max_length=4096)
    world_size: int | None = None
    nodes: list[str] = Field(default_factory=list)


# API shapes ------------------------------------------------------------------


class SpecView(BaseModel):
    """A job's spec as the API shows it: environment values are never echoed."""

    name: str
    command: list[str]
    working_dir: str | None
    env_names: list[str]
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    gpus_per_node: int = 0
    checkpoint_dir: str | None
    max_restarts: int
    node_selector: dict[str, str]
    priority: int
    queue: str = "default"
    resize_policy: ResizePolicy | None
    straggler_policy: StragglerPolicy = Field(default_factory=StragglerPolicy)
    grace_period_s: float
    zygote_preload: list[str] = Field(default_factory=list)

    @classmethod
    def of(cls, spec: JobSpec) -> SpecView:
        data = spec.model_dump(exclude={"env"})
        return cls(**data, env_names=sorted(spec.env))


class NodeInJob(BaseModel):
    node_id: str
    state: str
    ranks: list[int] = Field(default_factory=list)
    devices: list[int] = Field(
        default_factory=list, description="GPU indices the node's workers hold (NVML's)."
    )
    last_step: int | None = None
    restart_count: int = 0


class JobView(BaseModel):
    """``GET /v1/jobs/{id}``: the record joined with what the agents report."""

    job_id: str
    spec: SpecView
    phase: JobPhase
    cancel_requested: bool
    conditions: list[Condition]
    world_size: int
    nodes: list[NodeInJob]
    restarts: dict[str, int]
    restart_count: int
    last_step: int | None
    last_checkpoint_step: int | None
    # What the workers last reported (absent until they do): the job's samples per
    # second, its mean loss, when its newest checkpoint was written, the step it ends at.
    samples_per_second: float | None = None
    loss: float | None = None
    last_checkpoint_at: datetime | None = None
    total_steps: int | None = None
    # Goodput over the nodes' current generations (docs/checkpoints.md): productive
    # node-seconds / (productive + lost), and the node-seconds lost by cause.
    goodput: float | None = None
    lost_seconds: dict[str, float] = Field(default_factory=dict)
    exit_reason: ExitReason | None
    error: WorkerError | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobList(BaseModel):
    jobs: list[JobView]
    next_cursor: str | None = Field(
        default=None, description="Pass as ?cursor= for the next page; null on the last."
    )


class ScaleRequest(BaseModel):
    """``PATCH /v1/jobs/{id}``: new bounds; either may be left out."""

    model_config = ConfigDict(extra="forbid", strict=True)

    min_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    max_nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)

    @model_validator(mode="after")
    def _something(self) -> ScaleRequest:
        if self.min_nodes is None and self.max_nodes is None:
            raise ValueError("give min_nodes, max_nodes or both")
        return self


class SlowMark(BaseModel):
    """A node's ``slow`` condition: evicted from a job as a straggler, kept out of new
    placements until ``until`` (``P/slow/<node>``; written by the coordinator,
    cleared by an undrain)."""

    model_config = ConfigDict(extra="forbid")

    node_id: str
    job_id: str = Field(description="The job it was evicted from.")
    ratio: float = Field(ge=0, description="Its pace over the median of the job's other nodes.")
    since: datetime
    until: datetime = Field(description="The end of its cool-down.")

    def in_force(self, now: datetime) -> bool:
        """Whether the cool-down still lasts at ``now``."""
        return now < self.until


class NodeView(BaseModel):
    node_id: str
    host: str
    address: str
    state: Literal["live", "draining"]
    slots: int
    slots_used: int
    gpus: int
    gpus_used: int = Field(default=0, description="GPUs the jobs placed here asked for.")
    gpu_devices: list[GpuInfo] = Field(
        default_factory=list, description="Each GPU: index, UUID, model, locality, health."
    )
    labels: dict[str, str]
    jobs: list[str]
    slow: SlowMark | None = Field(
        default=None, description="Set while the node cools down after a straggler eviction.")


class EventList(BaseModel):
    events: list[JobEvent]


class ErrorBody(BaseModel):
    """Every error the API returns."""

    error: str
    detail: list[dict[str, object]] | None = None
