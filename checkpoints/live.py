"""Live resize: re-form the process group at a step boundary instead of restarting the workers.

A planned membership change (a node joins; a node is drained, scaled down by a
``PATCH`` or reclaimed) leaves every worker healthy. Rather than stopping them
all and restoring a checkpoint, the runners form the next rendezvous round
while their workers train on, then tell the workers; the workers stop at the
same step boundary, re-create the process group at the new world size and
rank, hand the state to whoever lacks it (a joining process) and go on. It
is turned on by ``Checkpointer(..., on_resize=hook)`` in a distributed job
run by a tidal runner (``TIDAL_PROGRESS_DIR`` set); the hook rebuilds what
depends on the group (DDP, the sampler, the data loader) from :class:`Resize`.

**Files** (all in the worker's progress directory, JSON, written to a
temporary file and renamed; a reader treats a missing or malformed file as
absent):

* ``live-resize.json``, from the runner of a node that stays, once its next
  round formed: the round number, the new master address and port, the new
  world size and this node's local-to-global rank map
  (:class:`ResizeNotice`). A newer round overwrites it.
* ``live-leave.json``, from the runner of a node that leaves (a planned stop):
  its workers train on until the group agrees to resize, then exit with
  :data:`EXIT_LEFT` (77) without saving: the others hold the state.
* ``live-<local_rank>.json``, from each worker (:class:`WorkerLive`): "ready"
  once its checkpointer can take the live path (the runner's test of
  capability), "resizing" when it acts, "resized" with the round and step
  when the new group trains, "left" right before exiting 77.

**Agreement.** The ranks must act at the same step, or the first collective of
the new group pairs the wrong calls. The checkpointer's
:class:`~checkpoints.signals.StepConsensus`, which already agrees on the stop
and save flags one step late, carries one more flag: the round of the newest
notice this rank has seen and not yet acted on (:func:`pending_round`). The
MAX over ranks is read by every rank at the same ``maybe_save`` call; if it is
newer than the rank's round, every rank acts there (:func:`decide`): a rank
whose node leaves drains the reduction in flight and exits; every other rank
waits (bounded) for its own notice of that round, drains, finishes an
asynchronous save in flight, destroys the process group and joins the new
one (:func:`rejoin`).

**State sync** (:func:`sync_state`, the same collective sequence on every
rank of the new group): an all-gather of each rank's live step (the step it
holds in memory; -1 for a process that has restored nothing yet). The source
is the lowest rank with the largest step (:func:`choose_source`). If some
rank is behind, the source sends the checkpoint's state: the model's tensors
are broadcast in place, everything else (optimizer, scheduler, scaler, RNG,
extras, step) as a skeleton of plain values followed by its tensors, each on
the group that suits its device (CPU tensors on the checkpointer's private
gloo group, CUDA tensors on the default group, NCCL on GPUs). A joining
process runs the same sequence as the first thing of ``restore()``, so it
receives the state from a peer instead of reading a checkpoint. The peers of
a job are trusted as DDP trusts them: the skeleton is pickled.

**Failure.** Anything that goes wrong on this path raises (a notice that does
not come, a peer that does not join the new group in time, a model that does
not fit): the worker fails and the runner falls back to restarting the group
from its checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.errors import CheckpointError, CheckpointStateError
from checkpoints.jit import _read_small

__all__ = [
    "EXIT_LEFT",
    "LEAVE_NOTICE",
    "LIVE_NOTICE_WAIT_S",
    "RESIZE_NOTICE",
    "Action",
    "LeaveNotice",
    "LiveResizeError",
    "LiveState",
    "Resize",
    "ResizeNotice",
    "SyncResult",
    "WorkerLink",
    "WorkerLive",
    "choose_source",
    "clear_live_files",
    "decide",
    "pending_round",
    "read_leave_notice",
    "read_resize_notice",
    "read_worker_live",
    "rejoin",
    "sync_state",
    "wait_for_notice",
    "worker_live_path",
    "write_leave_notice",
    "write_resize_notice",
    "write_worker_live",
]

log = logging.getLogger(__name__)

#: Exit code of a worker whose node left the job on the live path (nothing saved: the
#: others hold the state).
EXIT_LEFT = 77
#: The runner's notice to a staying node's workers: the next round's membership.
RESIZE_NOTICE = "live-resize.json"
#: The runner's notice to a leaving node's workers.
LEAVE_NOTICE = "live-leave.json"
#: How long a rank that must act waits for its own node's notice of the agreed round.
LIVE_NOTICE_WAIT_S = 30.0
_NOTICE_POLL_S = 0.02
#: The new group's timeout when the old one's cannot be read.
_DEFAULT_GROUP_TIMEOUT = datetime.timedelta(seconds=60)
_WORKER_PREFIX = "live-"


class LiveResizeError(CheckpointError):
    """The live path cannot go on (the worker fails; the runner restarts the group)."""


class LiveState(enum.StrEnum):
    """A worker's state on the live path: READY -> RESIZING -> RESIZED (-> RESIZING ...),
    or READY/RESIZED -> LEFT (terminal)."""

    READY = "ready"
    RESIZING = "resizing"
    RESIZED = "resized"
    LEFT = "left"

    def is_terminal(self) -> bool:
        return self is LiveState.LEFT


@dataclasses.dataclass(frozen=True)
class Resize:
    """What ``on_resize`` is told: the group it now trains in.

    Attributes:
        rank: this process's new global rank.
        world_size: the new world size.
        previous_world_size: the world size before.
        step: the completed optimizer steps the state holds (the sampler's start).
        round: the rendezvous round of the new group.
    """

    rank: int
    world_size: int
    previous_world_size: int
    step: int
    round: int


@dataclasses.dataclass(frozen=True)
class ResizeNotice:
    """``live-resize.json``: the new round, as this node's runner formed it.

    ``group_rank`` and ``group_world_size`` (the node's rank and the number of
    nodes) are optional: when present, workers export them as GROUP_RANK and
    GROUP_WORLD_SIZE.
    """

    round: int
    master_addr: str
    master_port: int
    world_size: int
    ranks: Mapping[int, int]  # local rank -> global rank
    written_at: float
    group_rank: int | None = None
    group_world_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "round": self.round,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "ranks": {str(local): rank for local, rank in sorted(self.ranks.items())},
            "written_at": self.written_at,
        }
        if self.group_rank is not None:
            body["group_rank"] = self.group_rank
        if self.group_world_size is not None:
            body["group_world_size"] = self.group_world_size
        return body

    @classmethod
    def from_json(cls, body: Any) -> ResizeNotice:
        """Parse and check a notice.

        Raises:
            ValueError: naming what is wrong with it.
        """
        if not isinstance(body, dict):
            raise ValueError("a resize notice must be a JSON object")
        world_size = _int(body, "world_size", minimum=1)
        ranks_in = body.get("ranks")
        if not isinstance(ranks_in, dict) or not ranks_in:
            raise ValueError("ranks must be a non-empty object")
        ranks: dict[int, int] = {}
        for local, rank in ranks_in.items():
            if not (isinstance(local, str) and local.isdigit()):
                raise ValueError(f"local rank {local!r} is not a number")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ValueError(f"rank {rank!r} is not within world size {world_size}")
            ranks[int(local)] = rank
        addr = body.get("master_addr")
        if not isinstance(addr, str) or not addr or len(addr) > 255:
            raise ValueError(f"master_addr {addr!r} is not a host name")
        port = _int(body, "master_port", minimum=1)
        if port > 65535:
            raise ValueError(f"master_port ({port}) is not a port")
        written = body.get("written_at", 0.0)
        if isinstance(written, bool) or not isinstance(written, int | float):
            raise ValueError(f"written_at ({written!r}) is not a time")
        return cls(
            round=_int(body, "round", minimum=1),
            master_addr=addr,
            master_port=port,
            world_size=world_size,
            ranks=ranks,
            written_at=float(written),
            group_rank=_int(body, "group_rank", minimum=0) if "group_rank" in body else None,
            group_world_size=(
                _int(body, "group_world_size", minimum=1) if "group_world_size" in body else None
            ),
        )


@dataclasses.dataclass(frozen=True)
class LeaveNotice:
    """``live-leave.json``: this node leaves the job (a planned stop)."""

    written_at: float


@dataclasses.dataclass(frozen=True)
class WorkerLive:
    """``live-<local_rank>.json``: a worker's live-path state, for its runner."""

    pid: int
    round: int
    step: int | None
    state: LiveState

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "round": self.round, "step": self.step, "state": str(self.state)}

    @classmethod
    def from_json(cls, body: Any) -> WorkerLive:
        """Raises: ValueError naming what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("a worker's live file must be a JSON object")
        step = body.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"step ({step!r}) is not an integer")
        return cls(
            pid=_int(body, "pid", minimum=1),
            round=_int(body, "round", minimum=0),
            step=step,
            state=LiveState(str(body.get("state"))),
        )


def _int(body: Mapping[str, Any], name: str, *, minimum: int) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} ({value!r}) must be an integer of at least {minimum}")
    return value


# ------------------------------------------------------------------- the files


def _write_json(path: Path, body: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically: a temporary file of our own in the same directory, renamed.

    Raises:
        OSError: when the directory is not writable.
    """
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)  # never write through a name someone else planted
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(body))
    os.replace(temp, path)


def _read_json(path: Path) -> Any:
    """The JSON in ``path`` (a small regular file, not followed through a link); None if none."""
    with contextlib.suppress(OSError, ValueError):
        data = _read_small(str(path))
        if data is not None:
            return json.loads(data)
    return None


def write_resize_notice(directory: Path, notice: ResizeNotice) -> None:
    """The runner: tell this node's workers the next round (replaces an older notice)."""
    _write_json(directory / RESIZE_NOTICE, notice.to_json())


def read_resize_notice(directory: Path) -> ResizeNotice | None:
    """The newest resize notice in ``directory``; None if missing or malformed."""
    body = _read_json(directory / RESIZE_NOTICE)
    if body is None:
        return None
    try:
        return ResizeNotice.from_json(body)
    except ValueError as exc:
        log.warning("ignoring the malformed %s: %s", RESIZE_NOTICE, exc)
        return None


def write_leave_notice(directory: Path, *, now: float | None = None) -> None:
    """The runner: tell this node's workers that the node leaves the job."""
    _write_json(directory / LEAVE_NOTICE, {"written_at": time.time() if now is None else now})


def read_leave_notice(directory: Path) -> LeaveNotice | None:
    """The leave notice in ``directory``; None if missing or malformed."""
    body = _read_json(directory / LEAVE_NOTICE)
    if not isinstance(body, dict):
        return None
    written = body.get("written_at")
    if isinstance(written, bool) or not isinstance(written, int | float):
        return None
    return LeaveNotice(written_at=float(written))


def worker_live_path(directory: Path, local_rank: int) -> Path:
    """Where the worker of ``local_rank`` reports its live-path state."""
    return directory / f"{_WORKER_PREFIX}{local_rank}.json"


def write_worker_live(directory: Path, local_rank: int, live: WorkerLive) -> None:
    """The worker: report its live-path state.

    Raises:
        OSError: when the progress directory is not writable.
    """
    _write_json(worker_live_path(directory, local_rank), live.to_json())


def read_worker_live(directory: Path, local_rank: int) -> WorkerLive | None:
    """The worker's live-path state; None if missing or malformed."""
    body = _read_json(worker_live_path(directory, local_rank))
    if body is None:
        return None
    try:
        return WorkerLive.from_json(body)
    except ValueError:
        return None


def _live_files(directory: Path) -> Iterator[str]:
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            name = entry.name
            if name in (RESIZE_NOTICE, LEAVE_NOTICE) or (
                name.startswith(_WORKER_PREFIX)
                and name.endswith(".json")
                and name[len(_WORKER_PREFIX) : -len(".json")].isdigit()
            ):
                yield entry.path


def clear_live_files(directory: Path) -> None:
    """The runner, before a new worker group starts: remove both notices and the workers' files."""
    for path in list(_live_files(directory)):
        with contextlib.suppress(OSError):
            os.unlink(path)


# -------------------------------------------------------------- the decisions


class Action(enum.StrEnum):
    """What a rank does at a step boundary once the ranks agreed on a round."""

    CONTINUE = "continue"
    RESIZE = "resize"
    LEAVE = "leave"


def pending_round(notice: ResizeNotice | None, current_round: int) -> int:
    """The flag a rank contributes: its notice's round if not yet acted on, else 0."""
    if notice is None or notice.round <= current_round:
        return 0
    return notice.round


def decide(
    *, agreed_round: int, current_round: int, leaving: bool, notice_round: int | None
) -> Action:
    """What to do at this boundary.

    Args:
        agreed_round: the MAX over ranks of :func:`pending_round` (0: no rank saw one).
        current_round: the round this rank last resized into (0: none).
        leaving: this rank's node has a leave notice.
        notice_round: the round of this node's resize notice, if any.

    Returns:
        CONTINUE when no newer round was agreed; LEAVE when this node leaves
        and has no notice of the agreed round or later (a node that leaves is
        not in the new round); RESIZE otherwise (the notice may still be on
        its way: :func:`wait_for_notice`).
    """
    if agreed_round <= current_round:
        return Action.CONTINUE
    if leaving and (notice_round is None or notice_round < agreed_round):
        return Action.LEAVE
    return Action.RESIZE


def choose_source(steps: Sequence[int]) -> tuple[int, int]:
    """The rank to take state from: the lowest rank holding the largest step.

    Args:
        steps: each rank's live step, by rank (-1: holds nothing live).

    Returns:
        (source rank, its step); the step is -1 when no rank holds anything.

    Raises:
        ValueError: when ``steps`` is empty.
    """
    if not steps:
        raise ValueError("no ranks to choose a source from")
    top = max(steps)
    return steps.index(top), top


def wait_for_notice(
    directory: Path,
    *,
    min_round: int,
    timeout: float = LIVE_NOTICE_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ResizeNotice:
    """Wait for this node's resize notice of ``min_round`` or later; return the newest.

    Raises:
        LiveResizeError: when none comes within ``timeout`` seconds.
    """
    deadline = clock() + timeout
    while True:
        notice = read_resize_notice(directory)
        if notice is not None and notice.round >= min_round:
            return notice
        if clock() >= deadline:
            seen = "none" if notice is None else f"round {notice.round}"
            raise LiveResizeError(
                f"no {RESIZE_NOTICE} of round {min_round} or later in {directory} after "
                f"{timeout:g} s (newest: {seen}): the ranks agreed to resize without this node"
            )
        sleep(_NOTICE_POLL_S)


class NoticeWatch:
    """Reads this node's resize notice again only when the file changed (one stat per step)."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / RESIZE_NOTICE
        self._directory = directory
        self._seen: tuple[int, int, int] | None = None
        self._notice: ResizeNotice | None = None

    def current(self) -> ResizeNotice | None:
        try:
            info = os.stat(self._path)
        except OSError:
            self._seen, self._notice = None, None
            return None
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key != self._seen:
            self._seen, self._notice = key, read_resize_notice(self._directory)
        return self._notice


class WorkerLink:
    """A worker's end of the files: its node's notices, its own ``live-<local_rank>.json``.

    Args:
        directory: the progress directory its runner watches.
        local_rank: this worker's local rank (its file's name).
    """

    def __init__(self, directory: Path, *, local_rank: int) -> None:
        self.directory, self.local_rank = directory, local_rank
        self.round = 0  # the round this worker last resized into
        self._watch = NoticeWatch(directory)

    def flag(self) -> int:
        """This rank's contribution to the agreement (:func:`pending_round`)."""
        return pending_round(self._watch.current(), self.round)

    def action(self, agreed_round: int) -> Action:
        """What to do now that the ranks agreed on ``agreed_round`` (:func:`decide`)."""
        notice = self._watch.current()
        return decide(
            agreed_round=agreed_round,
            current_round=self.round,
            leaving=read_leave_notice(self.directory) is not None,
            notice_round=None if notice is None else notice.round,
        )

    def notice(self, agreed_round: int) -> ResizeNotice:
        """This node's notice of ``agreed_round`` or later (waits, bounded; see
        :func:`wait_for_notice`)."""
        return wait_for_notice(self.directory, min_round=agreed_round)

    def report(self, state: LiveState, *, step: int | None) -> None:
        """Tell the runner where this worker is (a failure to write is logged: the runner
        then does not see the worker as capable, or times out and restarts the group)."""
        live = WorkerLive(pid=os.getpid(), round=self.round, step=step, state=state)
        try:
            write_worker_live(self.directory, self.local_rank, live)
        except OSError as exc:
            log.warning("cannot report the live-resize state to the runner: %s", exc)

    def withdraw(self) -> None:
        """This worker can no longer resize (its checkpointer is closed): remove its file."""
        with contextlib.suppress(OSError):
            worker_live_path(self.directory, self.local_rank).unlink()


# ------------------------------------------------------------- re-forming


def group_timeout() -> datetime.timedelta:
    """The default group's timeout (the script's choice), to give the new group the same."""
    with contextlib.suppress(Exception):  # private API: any failure means "unknown"
        group = dist.distributed_c10d._get_default_group()
        for device in group._device_types:
            timeout = group._get_backend(device).options._timeout
            if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
                return timeout
    return _DEFAULT_GROUP_TIMEOUT


def rejoin(notice: ResizeNotice, *, local_rank: int) -> tuple[int, int]:
    """Leave the current process group and join the one ``notice`` describes.

    Destroys every process group of this process (the default one and the
    subgroups), initializes the new default group with the same backend and
    timeout, and exports the new RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    (and GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE) for code
    that reads the environment later. The caller must have drained every
    collective in flight.

    Returns:
        (new rank, new world size).

    Raises:
        LiveResizeError: when the notice has no rank for ``local_rank``.
        RuntimeError, DistError: when the new group does not form in time.
    """
    rank = notice.ranks.get(local_rank)
    if rank is None:
        raise LiveResizeError(
            f"the round {notice.round} notice gives local rank {local_rank} no rank "
            f"(it names {sorted(notice.ranks)})"
        )
    backend = dist.get_backend()
    timeout = group_timeout()
    dist.destroy_process_group()
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(notice.world_size),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(notice.world_size),
        "MASTER_ADDR": notice.master_addr,
        "MASTER_PORT": str(notice.master_port),
    }
    if notice.group_rank is not None:
        env["GROUP_RANK"] = str(notice.group_rank)
    if notice.group_world_size is not None:
        env["GROUP_WORLD_SIZE"] = str(notice.group_world_size)
    os.environ.update(env)
    started = time.monotonic()
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{_host(notice.master_addr)}:{notice.master_port}",
        rank=rank,
        world_size=notice.world_size,
        timeout=timeout,
    )
    log.info(
        "joined round %d as rank %d of %d in %.2f s",
        notice.round, rank, notice.world_size, time.monotonic() - started,
    )
    return rank, notice.world_size


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


# ---------------------------------------------------------------- state sync


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a skeleton: received in order, allocated on its device type."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    cuda: bool


def _split(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """``tree`` with every tensor replaced by a :class:`_Slot` (the tensors appended in order)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach().contiguous())
        return _Slot(len(tensors) - 1, tuple(tree.shape), tree.dtype, tree.is_cuda)
    if isinstance(tree, dict):
        return {key: _split(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return _rebuild(tree, [_split(value, tensors) for value in tree])
    return tree


def _rebuild(like: list[Any] | tuple[Any, ...], values: list[Any]) -> Any:
    """A list or tuple (a named tuple too) of the same type as ``like``."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*values)
    return type(like)(values)


def _slots(skeleton: Any) -> Iterator[_Slot]:
    if isinstance(skeleton, _Slot):
        yield skeleton
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            yield from _slots(value)
    elif isinstance(skeleton, list | tuple):
        for value in skeleton:
            yield from _slots(value)


def _fill(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {key: _fill(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return _rebuild(skeleton, [_fill(value, tensors) for value in skeleton])
    return skeleton


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """What the state sync did for this rank.

    Attributes:
        source: the rank the state came from.
        step: its step (-1: no rank held anything live; nothing was sent).
        state: the state received, when this rank was behind (its model is
            already loaded in place); None when it kept its own.
    """

    source: int
    step: int
    state: dict[str, Any] | None


def sync_state(
    *,
    live_step: int,
    group: dist.ProcessGroup | None,
    model: torch.nn.Module,
    capture: Callable[[], dict[str, Any]],
) -> SyncResult:
    """Give every rank of the current group the state of the rank furthest ahead.

    Every rank of the default group calls this with the same ``group`` (a gloo
    group over all of them; None with a single rank).

    Args:
        live_step: the step this rank holds in memory (-1: nothing live).
        group: the gloo group for the step exchange, the skeleton and CPU tensors.
        model: the model; the source's tensors are broadcast into it in place.
        capture: on the source, the rest of the state (optimizer, scheduler,
            RNG, extras, step ...), a tree of plain values and tensors.

    Returns:
        Who was the source and, on a rank that was behind, the state it received.

    Raises:
        CheckpointStateError: when the model's tensors differ from the source's.
        RuntimeError, DistError: when a collective fails.
    """
    if group is None:
        return SyncResult(source=0, step=live_step, state=None)
    world_size = dist.get_world_size(group)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([live_step], dtype=torch.int64), group=group)
    steps = [int(t.item()) for t in gathered]
    source, top = choose_source(steps)
    if top < 0 or all(step == top for step in steps):
        return SyncResult(source=source, step=top, state=None)
    rank = dist.get_rank()
    behind = steps[rank] < top
    log.info("live state sync: rank %d sends step %d (steps %s)", source, top, steps)
    params = model.state_dict()
    layout = [(name, tuple(t.shape), t.dtype) for name, t in params.items()]
    tensors: list[torch.Tensor] = []
    box: list[Any] = [None, None]
    if rank == source:
        box = [layout, _split(capture(), tensors)]
    dist.broadcast_object_list(box, src=source, group=group)
    source_layout, skeleton = box
    if source_layout != layout:
        raise CheckpointStateError(
            f"this rank's model ({len(layout)} tensors) differs from rank {source}'s "
            f"({len(source_layout)} tensors): the live state does not fit it"
        )
    with torch.no_grad():
        for tensor in params.values():
            _broadcast(tensor, src=source, group=group)
        if rank != source:
            device = torch.device("cuda", torch.cuda.current_device()) if any(
                slot.cuda for slot in _slots(skeleton)
            ) else None
            for slot in _slots(skeleton):
                where = device if slot.cuda and device is not None else torch.device("cpu")
                tensors.append(torch.empty(slot.shape, dtype=slot.dtype, device=where))
        for tensor in tensors:
            _broadcast(tensor, src=source, group=group)
    state = _fill(skeleton, tensors) if behind else None
    return SyncResult(source=source, step=top, state=state)


def _broadcast(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup) -> None:
    """CPU tensors over the gloo group; device tensors over the default group (NCCL on GPUs)."""
    dist.broadcast(tensor, src=src, group=group if not tensor.is_cuda else None)
