"""Just-in-time save for the Hugging Face ``Trainer``: the last completed step, in its layout.

When a peer dies, a survivor's ``trainer.train()`` raises from a failed
collective (gloo: the dead peer's sockets close during DDP's gradient
all-reduce, inside ``backward``). The model and optimizer are then still those
of the last completed step, on every survivor: under DDP each holds a full
replica, and they change only inside ``optimizer.step()``. :class:`HFJustInTimeSave`
writes that step as a Trainer checkpoint in ``args.output_dir``, in the layout
``trainer.train(resume_from_checkpoint=True)`` resumes from (transformers 5.x's
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
``_load_rng_state``): the model through ``save_pretrained`` (safetensors and
config), ``training_args.bin``, ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` (when there is a grad scaler), ``rng_state_<process_index>.pth``
(``rng_state.pth`` for one process) and ``trainer_state.json``, written last.

**Which step.** :meth:`HFJustInTimeSave.boundary` runs in the callback's
``on_step_end``, before any collective of tidal's: it records the step and
copies what changes after the optimizer step (the scheduler's and the grad
scaler's state, the random generators'). An optimizer step pre-hook marks the
live state *dirty* as soon as the next optimizer step begins; a dirty state, or
a ``state.global_step`` other than the recorded one, is never saved
(:func:`choose_step`), as in :mod:`checkpoints.jit`.

**No collective, several writers.** The group is broken, so nobody agrees on
a writer: every survivor writes its own ``rng_state`` file, and the first to
commit puts the shared files in place (:func:`commit_checkpoint`): they are
written to a hidden temporary directory (``.checkpoint-<step>.tidal-*``, which
``get_last_checkpoint`` and the Trainer's rotation never match), fsynced and
renamed to ``checkpoint-<step>``; a later survivor finds it complete and adds
only its ``rng_state`` file (temporary file, rename). The commits are
serialized by an ``flock`` on ``<output_dir>/.tidal-jit.lock`` (released by the
kernel if the holder dies). A complete checkpoint of the same or a newer step
is never overwritten; an incomplete ``checkpoint-<step>`` (a Trainer save cut
short) has its files replaced one by one, ``trainer_state.json`` last. Only
local rank 0 of a node writes the shared files (one copy per node, as the
Checkpointer); the node's other ranks add their ``rng_state`` file, parked in
``.checkpoint-<step>.tidal-rng`` until the shared files are in place.

**Triggers**, as :mod:`checkpoints.jit`: a ``sys.excepthook`` (chained to the
one it replaces) saves when the exception that ends the process is a failed
collective (:func:`checkpoints.jit.is_collective_failure`); under tidal, a
watcher thread also saves when the runner writes its ``peer-lost`` notice (a
rank blocked in a collective that never returns), and the rank keeps its
``saving-rank-<RANK>.json`` report up to date (:mod:`checkpoints.protocol.jit`)
so that the runner waits for the save. Either way the save happens once. After
the excepthook's save the process ends at once with exit code 1 (``os._exit``,
after the traceback): the interpreter's teardown of the broken group would
otherwise block, up to the collective timeout, on DDP's other gradient buckets
still waiting for a live survivor that is itself saving or exiting.

Sharded state (FSDP, DeepSpeed) is held by no single rank: no just-in-time save
there (:func:`sharded_reason`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import enum
import fcntl
import logging
import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from checkpoints.files import fsync_dir
from checkpoints.jit import is_collective_failure
from checkpoints.protocol.jit import (
    ARMED,
    DONE,
    FAILED,
    NOTICE_NAME,
    SAVING,
    SKIPPED,
    SavingReport,
    report_path,
    write_report,
)

__all__ = [
    "HFJustInTimeSave",
    "Outcome",
    "checkpoint_name",
    "choose_step",
    "commit_checkpoint",
    "is_complete",
    "newest_complete_step",
    "sharded_reason",
]

log = logging.getLogger(__name__)

# transformers' file names (trainer.py, utils/__init__.py), kept here so that
# nothing needs transformers imported to write or check a checkpoint.
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint
_LOCK_NAME = ".tidal-jit.lock"
_POLL_S = 0.05
_BEAT_S = 0.1


class Outcome(str, enum.Enum):
    """What :func:`commit_checkpoint` did."""

    WRITTEN = "written"  # this rank put the shared files (and its rng file) in place
    JOINED = "joined"  # the checkpoint was there: this rank added its rng file
    PARKED = "parked"  # no shared files yet: this rank's rng file waits beside them
    NEWER = "newer"  # a complete checkpoint of a newer step exists: nothing written


def checkpoint_name(step: int) -> str:
    """The Trainer's directory name for ``step`` (``PREFIX_CHECKPOINT_DIR``-step)."""
    return f"checkpoint-{step}"


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a whole Trainer checkpoint (the trainer state is written last)."""
    return (path / TRAINER_STATE_NAME).is_file() and any((path / w).is_file() for w in _WEIGHTS)


def newest_complete_step(output_dir: Path) -> int | None:
    """The newest step with a complete ``checkpoint-<step>`` in ``output_dir`` (None: none)."""
    steps = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(output_dir):
            match = _CHECKPOINT.match(entry.name)
            if match and entry.is_dir() and is_complete(Path(entry.path)):
                steps.append(int(match.group(1)))
    return max(steps, default=None)


def choose_step(
    recorded: int | None, *, dirty: bool, global_step: int | None
) -> tuple[int | None, str]:
    """The step to save after a failure, or None and why not.

    Args:
        recorded: the last step whose ``on_step_end`` ran (None: none yet).
        dirty: whether an optimizer step has begun since.
        global_step: the Trainer's ``state.global_step`` now.
    """
    if recorded is None:
        return None, "no step completed yet"
    if dirty:
        return None, "an optimizer step had begun after the last completed step"
    if global_step is not None and global_step != recorded:
        return None, (f"the trainer is at step {global_step}, "
                      f"not at the last completed step {recorded}")
    return recorded, ""


def sharded_reason(args: Any) -> str | None:
    """Why the Trainer's state is sharded across ranks (FSDP, DeepSpeed); None: replicated."""
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "FSDP shards the model and optimizer across ranks"
    if getattr(args, "deepspeed", None) or (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    ):
        return "DeepSpeed shards the optimizer (and possibly the model) across ranks"
    return None


# ------------------------------------------------------------------ the commit


def commit_checkpoint(
    output_dir: Path,
    step: int,
    *,
    rng_name: str,
    write_rng: Callable[[Path], None],
    write_shared: Callable[[Path], None] | None,
) -> Outcome:
    """Put this rank's part of ``checkpoint-<step>`` into ``output_dir``, with no collective.

    Args:
        output_dir: the Trainer's ``args.output_dir``.
        step: the step saved.
        rng_name: this rank's random-state file name.
        write_rng: writes this rank's random state to the path it is given.
        write_shared: writes the shared files (model, optimizer, scheduler,
            arguments, trainer state last) into the directory it is given;
            None: this rank writes only its random state.

    Returns:
        What was done (:class:`Outcome`). Safe for several ranks at once; never
        replaces a complete checkpoint of ``step`` or a newer one.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / checkpoint_name(step)
    if _newer(output_dir, step):
        return Outcome.NEWER
    temp: Path | None = None
    try:
        if write_shared is not None and not is_complete(final):
            temp = _write_temp(output_dir, step, rng_name, write_rng, write_shared)
        with _locked(output_dir):
            if _newer(output_dir, step):
                return Outcome.NEWER
            if is_complete(final):
                _add_file(final, rng_name, write_rng)
                return Outcome.JOINED
            if write_shared is None:
                target = final if final.is_dir() else _parked(output_dir, step)
                _add_file(target, rng_name, write_rng)
                return Outcome.PARKED if target != final else Outcome.JOINED
            if temp is None:  # it was complete and is no longer (rotated away): write it now
                temp = _write_temp(output_dir, step, rng_name, write_rng, write_shared)
            try:
                os.rename(temp, final)  # fails if a non-empty checkpoint-<step> exists
            except OSError:
                _replace_files(temp, final)  # an incomplete one: ours, file by file
            else:
                temp = None  # an incomplete one: ours, file by file
            _adopt_parked(output_dir, step, final)
            fsync_dir(final)
            fsync_dir(output_dir)
            return Outcome.WRITTEN
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _newer(output_dir: Path, step: int) -> bool:
    newest = newest_complete_step(output_dir)
    return newest is not None and newest > step


def _write_temp(
    output_dir: Path, step: int, rng_name: str,
    write_rng: Callable[[Path], None], write_shared: Callable[[Path], None],
) -> Path:
    temp = output_dir / f".{checkpoint_name(step)}.tidal-{os.getpid()}-{time.monotonic_ns()}"
    temp.mkdir()
    try:
        write_rng(temp / rng_name)
        write_shared(temp)
        for path in temp.rglob("*"):
            if path.is_file():
                _fsync_file(path)
        fsync_dir(temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return temp


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _add_file(directory: Path, name: str, write: Callable[[Path], None]) -> None:
    """Add ``name`` to ``directory`` unless it is there (temporary file, fsync, rename)."""
    directory.mkdir(exist_ok=True)
    path = directory / name
    if path.exists():
        return
    temp = directory / f".{name}.tidal-{os.getpid()}.tmp"
    try:
        write(temp)
        _fsync_file(temp)
        os.replace(temp, path)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()
    fsync_dir(directory)


def _replace_files(source: Path, final: Path) -> None:
    """Move ``source``'s files over an incomplete ``final``'s, the trainer state last."""
    names = sorted(p.name for p in source.iterdir())
    names.sort(key=lambda n: n == TRAINER_STATE_NAME)
    for name in names:
        if name.startswith("rng_state") and (final / name).exists():
            continue  # another rank's (or our own earlier) random state: keep it
        with contextlib.suppress(OSError):  # a directory over a non-empty one: keep theirs
            os.replace(source / name, final / name)


def _parked(output_dir: Path, step: int) -> Path:
    return output_dir / f".{checkpoint_name(step)}.tidal-rng"


def _adopt_parked(output_dir: Path, step: int, final: Path) -> None:
    parked = _parked(output_dir, step)
    if not parked.is_dir():
        return
    for path in parked.iterdir():
        if not (final / path.name).exists() and not path.name.startswith("."):
            os.replace(path, final / path.name)
    shutil.rmtree(parked, ignore_errors=True)


@contextlib.contextmanager
def _locked(output_dir: Path) -> Iterator[None]:
    fd = os.open(output_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# -------------------------------------------------------------------- the saver


def _rng_state(distributed: bool) -> dict[str, Any]:
    """The random generators' states, as ``Trainer._save_rng_state`` writes them."""
    import numpy as np

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = (torch.cuda.random.get_rng_state_all() if distributed
                          else torch.cuda.random.get_rng_state())
    return states


def _state_dict_copy(obj: Any) -> Any:
    return None if obj is None else copy.deepcopy(obj.state_dict())


class HFJustInTimeSave:
    """Saves the Trainer's last completed step as ``checkpoint-<step>`` when training fails.

    Made by the callback at ``on_train_begin`` from the Trainer's objects.

    Args:
        args: the ``TrainingArguments`` (``output_dir``, ``process_index``, ``world_size``).
        state: the live ``TrainerState``.
        model: the unwrapped model (``save_pretrained`` when it has it).
        optimizer: the Trainer's optimizer (accelerate's wrapper or a torch one).
        lr_scheduler: the Trainer's scheduler (None: none).
        processing_class: the tokenizer or processor, saved beside the model (None: none).
        rank: this process's global rank (for the runner's report).
        local_rank: this process's rank on its node (0 writes the shared files).
        progress_dir: where the runner's notice and this rank's report live (None: no runner).
        exit_at_once: after the excepthook's save, end the process at once
            (``os._exit(1)``), skipping the interpreter's teardown of the broken
            group, which can block up to the collective timeout.
    """

    def __init__(
        self,
        *,
        args: Any,
        state: Any,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any = None,
        processing_class: Any = None,
        rank: int = 0,
        local_rank: int = 0,
        progress_dir: Path | None = None,
        exit_at_once: bool = True,
    ) -> None:
        self._exit_at_once = exit_at_once
        self._args, self._state, self._model = args, state, model
        self._optimizer, self._scheduler = optimizer, lr_scheduler
        self._scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer
        self._processing_class = processing_class
        self._rank, self._local_rank, self._progress_dir = rank, local_rank, progress_dir
        mode = getattr(getattr(args, "parallel_mode", None), "value", "")
        self._distributed = mode == "distributed"
        self._lock = threading.Lock()  # the state is not changing while this is held
        self._step: int | None = None
        self._small: dict[str, Any] = {}
        self._dirty = True
        self._started = False
        self._saved = threading.Event()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._previous_hook: Any = None
        self._writing: Path | None = None  # the directory the shared files go to
        self._bytes = 0
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer that steps
        self._hook = inner.register_step_pre_hook(self._before_optimizer_step)
        self._armed_at = time.time()
        #: What the save did (None: not saved, or nothing safe to save).
        self.outcome: Outcome | None = None
        #: The checkpoint directory the save committed to.
        self.path: Path | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self._args.output_dir)

    @property
    def rng_name(self) -> str:
        """This rank's random-state file, as ``Trainer._save_rng_state`` names it."""
        if int(getattr(self._args, "world_size", 1) or 1) <= 1:
            return "rng_state.pth"
        return f"rng_state_{int(self._args.process_index)}.pth"

    # ------------------------------------------------------------ the boundary

    def boundary(self, step: int) -> None:
        """``step`` optimizer steps are complete (``on_step_end``): remember what changes next."""
        small = {
            "rng": _rng_state(self._distributed),
            "scheduler": _state_dict_copy(self._scheduler),
            "scaler": _state_dict_copy(self._scaler),
        }
        with self._lock:
            self._step, self._small, self._dirty = step, small, False

    def _before_optimizer_step(self, *_: Any) -> None:
        with self._lock:
            self._dirty = True

    # ---------------------------------------------------------------- triggers

    def arm(self) -> None:
        """Save on a failed collective (excepthook) or the runner's notice (a thread)."""
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._finish_in_flight)
        if self._progress_dir is None:
            return
        self._report(ARMED)
        self._watcher = threading.Thread(target=self._watch, name="hf-jit", daemon=True)
        self._watcher.start()

    def disarm(self) -> None:
        """Stop watching; remove the hooks (training ended or stopped cleanly)."""
        self._stop.set()
        self._hook.remove()
        atexit.unregister(self._finish_in_flight)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook or sys.__excepthook__
        if self._progress_dir is not None and not self._started:
            with contextlib.suppress(OSError):
                report_path(self._progress_dir, self._rank).unlink()

    def save_if_collective_failure(self, exc: BaseException) -> Path | None:
        """For a script that catches ``train()``'s exception: save if it is a failed collective."""
        if is_collective_failure(exc):
            return self.save(f"a collective failed ({type(exc).__name__})")
        return None

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        failed = False
        try:
            failed = is_collective_failure(value)
            if failed:
                self.save(f"a collective failed ({kind.__name__})")
        finally:
            (self._previous_hook or sys.__excepthook__)(kind, value, tb)
        if failed and self._exit_at_once:
            # The group is broken, but DDP's other buckets may still wait on a live
            # survivor: tearing the group down at interpreter exit would block in
            # its destructor up to the collective timeout (gloo's default: 30 min).
            # Leave now, with the exit code of an uncaught exception.
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)

    def _finish_in_flight(self) -> None:
        if self._started:
            self._saved.wait()

    def _watch(self) -> None:
        assert self._progress_dir is not None
        notice = self._progress_dir / NOTICE_NAME
        while not self._stop.wait(_POLL_S):
            try:
                noticed = notice.stat().st_mtime >= self._armed_at - 1.0
            except OSError:
                continue
            if noticed:
                self.save("the runner says a peer is gone")
                return

    # -------------------------------------------------------------------- save

    def save(self, reason: str) -> Path | None:
        """Write the last completed step as ``checkpoint-<step>``, once; wait if one is in flight.

        Returns:
            The checkpoint's directory, or None when there was nothing safe to
            save, a newer complete checkpoint exists, or the save failed.
        """
        with self._lock:  # an optimizer step that would begin now waits for the save
            first = not self._started
            self._started = True
            if first:
                return self._save_locked(reason)
        self._saved.wait()
        return self.path

    def _save_locked(self, reason: str) -> Path | None:
        try:
            step, why = choose_step(self._step, dirty=self._dirty,
                                    global_step=getattr(self._state, "global_step", None))
            if step is None:
                log.warning("no just-in-time save (%s): %s", reason, why)
                self._report(SKIPPED, detail=why)
                return None
            started = time.monotonic()
            log.warning("just-in-time save of step %d as a Trainer checkpoint: %s", step, reason)
            self._report(SAVING, step=step)
            beat = threading.Thread(target=self._beat, args=(step,), daemon=True)
            beat.start()
            try:
                self.outcome = commit_checkpoint(
                    self.output_dir, step, rng_name=self.rng_name, write_rng=self._write_rng,
                    write_shared=self._write_shared if self._local_rank == 0 else None,
                )
            except Exception as exc:  # the process is ending: say why, go on
                log.error("the just-in-time save of step %d failed: %s", step, exc)
                self._report(FAILED, step=step, detail=str(exc)[:500])
                return None
            finally:
                self._stop.set()
                beat.join(timeout=1.0)  # its last report must not land after ours
            if self.outcome is Outcome.NEWER:
                log.warning("no just-in-time save of step %d: a newer complete checkpoint "
                            "exists in %s", step, self.output_dir)
                self._report(SKIPPED, step=step, detail="a newer checkpoint exists")
                return None
            self.path = self.output_dir / checkpoint_name(step)
            log.warning("just-in-time save of step %d %s %s in %.2f s", step,
                        self.outcome.value, self.path, time.monotonic() - started)
            self._report(DONE, step=step, written=self._written())
            return self.path
        finally:
            self._saved.set()

    def _write_rng(self, path: Path) -> None:
        torch.save(self._small["rng"], path)

    def _write_shared(self, directory: Path) -> None:
        """The files ``Trainer._save_checkpoint`` writes once per checkpoint (DDP or one device)."""
        self._writing = directory
        model: Any = self._model
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(str(directory), is_main_process=True)
        else:
            import safetensors.torch

            safetensors.torch.save_file(model.state_dict(), str(directory / _WEIGHTS[0]),
                                        metadata={"format": "pt"})
        processing = self._processing_class
        if processing is not None and hasattr(processing, "save_pretrained"):
            processing.save_pretrained(str(directory))
        torch.save(self._args, directory / TRAINING_ARGS_NAME)
        torch.save(self._optimizer.state_dict(), directory / OPTIMIZER_NAME)
        if self._small.get("scheduler") is not None:
            torch.save(self._small["scheduler"], directory / SCHEDULER_NAME)
        if self._small.get("scaler") is not None:
            torch.save(self._small["scaler"], directory / SCALER_NAME)
        self._state.save_to_json(str(directory / TRAINER_STATE_NAME))

    def _written(self) -> int:
        """Bytes in the directory being written (the runner waits while this grows)."""
        total = 0
        with contextlib.suppress(OSError):
            if self._writing is not None:
                for entry in os.scandir(self._writing):
                    with contextlib.suppress(OSError):
                        total += entry.stat(follow_symlinks=False).st_size
        self._bytes = max(self._bytes, total)  # the directory is gone once renamed
        return self._bytes

    def _beat(self, step: int) -> None:
        while not self._stop.wait(_BEAT_S):
            self._report(SAVING, step=step, written=self._written())

    def _report(self, state: str, *, step: int = -1, written: int = 0, detail: str = "") -> None:
        if self._progress_dir is None:
            return
        write_report(self._progress_dir, SavingReport(
            rank=self._rank, pid=os.getpid(), state=state, step=step, bytes=written,
            time=time.time(), detail=detail,
        ))
