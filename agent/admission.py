"""Which assignments an agent may run: only those the coordinator wrote.

An assignment is a command to run on this node, and whoever can write
``assignments/<node>/<job>`` in etcd could otherwise make the agent run
anything. With etcd's authentication on, only the coordinator's user may
write there (deploy/etcd/setup-auth.sh); this module is the agent's own
check on top of that, which also keeps an orphan assignment (one whose job
is gone) from running:

* the job must exist: ``jobs/<job>`` holds its record, which only the
  coordinator writes;
* the record must give this node this very generation (``nodes``, which the
  coordinator writes in the same transaction as the assignments, or, for a
  job too large for one, just after them: an ignored assignment is asked
  about again);
* the assignment must say what the record says: command, working directory,
  environment, bounds, restart budget, grace period, checkpoint path and the
  modules its zygote preloads (which it imports in the job's workers), so
  an assignment edited after the coordinator wrote it does not run either.

:func:`decide` is the pure decision. :class:`AssignmentGate` applies it for
the daemon: it reads the job's record once per new assignment (a ``get``,
not a watch of every job), remembers what it decided per assignment revision,
and asks again, with a growing pause, for one it ignored (the record may
still be on its way), logging each ignored assignment once.

The agent's etcd user therefore needs read access to ``jobs/``. A job record
holds no more than the job's assignments already do (the spec, its
environment included), which every agent can read.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from checkpoints.protocol import env as worker_env
from rendezvous.errors import EtcdError
from rendezvous.etcd import EtcdClient, KeyValue
from rendezvous.records import Assignment

log = logging.getLogger(__name__)

#: Variables the coordinator adds to a job's environment from its resize
#: policy (service.api.models.ResizePolicy.env); users cannot set ``TIDAL_*``.
RESIZE_ENV = (worker_env.RESIZE_POLICY, worker_env.GLOBAL_BATCH_SIZE)
#: Pauses between two looks at an ignored assignment's job record.
RECHECK_FIRST_S = 0.25
RECHECK_MAX_S = 5.0


class _ResizePolicyView(BaseModel):
    model_config = ConfigDict(extra="ignore")

    global_batch_size: int | None = None
    lr_rule: str = "none"


class _JobSpecView(BaseModel):
    """The fields of the coordinator's job spec that an assignment repeats."""

    model_config = ConfigDict(extra="ignore")

    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    min_nodes: int
    max_nodes: int
    nproc_per_node: int = 1
    max_restarts: int = 3
    grace_period_s: float = 30.0
    resize_policy: _ResizePolicyView | None = None
    zygote_preload: list[str] = Field(default_factory=list)


class JobRecordView(BaseModel):
    """What the agent reads of ``jobs/<id>`` (service.api.models.JobRecord, written
    by the coordinator only); other fields are the coordinator's business."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    spec: _JobSpecView
    cwd: str | None = None
    checkpoint_path: str | None = None
    nodes: dict[str, int] = Field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    """The decision on one assignment: ``run`` it or not, and why not."""

    run: bool
    reason: str = ""


ADMIT = Admission(True)


def _expected_env(spec: _JobSpecView) -> dict[str, str]:
    env = dict(spec.env)
    policy = spec.resize_policy
    if policy is not None:
        env[worker_env.RESIZE_POLICY] = policy.lr_rule
        if policy.global_batch_size is not None:
            env[worker_env.GLOBAL_BATCH_SIZE] = str(policy.global_batch_size)
    return env


def _differences(assignment: Assignment, record: JobRecordView) -> list[str]:
    """The names of the assignment's fields that differ from the job record's."""
    spec = record.spec
    expected = {
        "command": spec.command,
        "cwd": record.cwd,
        "env": _expected_env(spec),
        "min_nodes": spec.min_nodes,
        "max_nodes": spec.max_nodes,
        "nproc_per_node": spec.nproc_per_node,
        "max_restarts": spec.max_restarts,
        "checkpoint_dir": record.checkpoint_path,
        "grace_period_s": spec.grace_period_s,
        "zygote_preload": spec.zygote_preload,
    }
    differ = [name for name, value in expected.items() if getattr(assignment, name) != value]
    if assignment.rdzv_conf:  # the coordinator never sets it
        differ.append("rdzv_conf")
    return differ


def decide(assignment: Assignment, node_id: str, record: bytes | None) -> Admission:
    """Whether ``node_id`` may run ``assignment``, given its job's record.

    Args:
        assignment: what ``assignments/<node_id>/<job>`` holds.
        node_id: this node.
        record: the raw value of ``jobs/<job>``, or None if there is no such key.

    Returns:
        :data:`ADMIT`, or an :class:`Admission` whose ``reason`` is a sentence
        saying what does not match (never a value: the environment may hold
        secrets).
    """
    job_id = assignment.job_id
    if record is None:
        return Admission(False, f"job {job_id} does not exist (no job record)")
    try:
        view = JobRecordView.model_validate_json(record)
    except ValidationError as exc:
        return Admission(
            False, f"the record of job {job_id} is not a job record ({exc.error_count()} errors)"
        )
    if view.job_id != job_id:
        return Admission(False, f"the record at job {job_id}'s key is job {view.job_id}'s")
    given = view.nodes.get(node_id)
    if given is None:
        return Admission(False, f"job {job_id} is not assigned to node {node_id} by its record")
    if given != assignment.generation:
        return Admission(
            False,
            f"job {job_id}'s record gives node {node_id} generation {given}, "
            f"not {assignment.generation}",
        )
    differ = _differences(assignment, view)
    if differ:
        return Admission(
            False, f"the assignment of job {job_id} differs from its record in {', '.join(differ)}"
        )
    return ADMIT


def record_nodes(job_id: str, record: bytes | None) -> dict[str, int]:
    """The nodes ``job_id``'s record (``jobs/<job>``) places it on, each with its generation.

    What the coordinator assigns, as opposed to the ``assignments/`` keys,
    which anyone who can write to etcd could add. None for a missing record,
    one that is not a job record, or one of another job.
    """
    if record is None:
        return {}
    try:
        view = JobRecordView.model_validate_json(record)
    except ValidationError:
        return {}
    return dict(view.nodes) if view.job_id == job_id else {}


@dataclass
class _Seen:
    """What the gate decided for one revision of one assignment key."""

    mod_revision: int
    admission: Admission
    next_check: float
    pause_s: float


class AssignmentGate:
    """Filters the assignments the daemon sees down to those it may start.

    Args:
        client: the agent's etcd client (it reads ``jobs/<job>``).
        node_id: this node.
        clock: monotonic seconds (injected by tests).
    """

    def __init__(
        self, client: EtcdClient, node_id: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.clock = clock
        self._seen: dict[str, _Seen] = {}  # assignment key -> last decision

    def admitted(self, key: str, kv: KeyValue, assignment: Assignment) -> bool:
        """Whether the assignment held by ``kv`` may start a runner.

        An etcd error counts as "not yet" (it is asked again), never as a
        reason to stop anything.
        """
        now = self.clock()
        seen = self._seen.get(key)
        # An admitted revision is never asked again (next_check is infinite).
        if seen is not None and seen.mod_revision == kv.mod_revision and now < seen.next_check:
            return seen.admission.run
        try:
            record = self.client.get(self.client.keys.job(assignment.job_id))
        except EtcdError as exc:
            log.warning("cannot read the record of job %s (%s); asking again", assignment.job_id,
                        exc)
            return False
        admission = decide(assignment, self.node_id, None if record is None else record.value)
        if admission.run:
            if seen is not None and not seen.admission.run:
                log.info("assignment %s: its job record matches now", key)
            self._seen[key] = _Seen(kv.mod_revision, admission, math.inf, 0.0)
            return True
        if seen is None or seen.mod_revision != kv.mod_revision:
            pause = RECHECK_FIRST_S
            log.warning("ignoring assignment %s (not run): %s", key, admission.reason)
        else:
            pause = min(seen.pause_s * 2, RECHECK_MAX_S)
            if seen.admission != admission:
                log.warning("ignoring assignment %s (not run): %s", key, admission.reason)
        self._seen[key] = _Seen(kv.mod_revision, admission, now + pause, pause)
        return False

    def forget_except(self, keys: Mapping[str, object]) -> None:
        """Drop what was decided for assignment keys that are gone."""
        for key in list(self._seen):
            if key not in keys:
                del self._seen[key]
