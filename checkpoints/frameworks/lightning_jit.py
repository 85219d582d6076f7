"""Just-in-time save for Lightning: the last completed step, as ``last.ckpt``, when a peer dies.

When a peer dies, a survivor's ``trainer.fit`` raises from a failed collective
(gloo: the dead peer's sockets close during DDP's gradient all-reduce, inside
``backward``). The model and optimizer are then still those of the last
completed step on every survivor: under DDP each holds a full replica, and they
change only inside ``optimizer.step()``. :class:`LightningJustInTimeSave` writes
that step as a Lightning checkpoint named ``last.ckpt`` in the checkpoint
directory (the ``ModelCheckpoint``'s), which ``trainer.fit(model,
ckpt_path="last")`` resumes from: Lightning takes the most recently modified
``last*.ckpt`` of its ``ModelCheckpoint`` directories.

**Which step, which state.** :meth:`LightningJustInTimeSave.boundary` runs in
the callback's ``on_train_batch_end`` after an optimizer step, before any
collective of tidal's, at the same point where Lightning's own
``ModelCheckpoint(every_n_train_steps=...)`` saves: it records the step and
copies what the next step changes before it could be saved (the loops' progress,
the schedulers', the precision plugin's state). The callback's
``on_before_optimizer_step`` marks the live state *dirty*
(:meth:`~checkpoints.jit.JustInTimeTrigger.mark_dirty`): Lightning runs the
forward and backward pass as a closure *inside* ``optimizer.step()``, so an
optimizer step pre-hook would fire before the very backward pass that fails;
that hook runs after the closure, just before the parameters change. Dirty
state is never saved. At the save the rest
comes from Lightning's own ``dump_checkpoint`` (model, optimizers, callbacks,
hyper-parameters, the datamodule, the ``on_save_checkpoint`` hooks), with the
recorded parts put over the live ones: the checkpoint is the one Lightning would
have written at that step's end.

**No collective, several writers** (:func:`commit_last`): each writer writes a
temporary file beside ``last.ckpt``, then, holding the directory's ``flock``,
renames it over ``last.ckpt`` unless that already holds the same step (another
survivor's identical copy) or a newer one. Only local rank 0 of a node writes
(one copy per node, as the Checkpointer).

**Triggers.** The callback's ``on_exception`` (Lightning calls it before
tearing down) saves when the exception is a failed collective; a
``sys.excepthook`` does too, for a failure outside ``fit``'s handling, and then
ends the process at once (``os._exit(1)``: the interpreter's teardown of the
broken group can block up to the collective timeout); under tidal, a watcher
thread saves on the runner's ``peer-lost`` notice, with the reports the runner
waits on. Either way the save happens once.

Sharded state (FSDP, DeepSpeed, a ``ZeroRedundancyOptimizer``) is held by no
single rank: no just-in-time save there (:func:`sharded_reason`).
"""

from __future__ import annotations

import copy
import enum
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from checkpoints.files import fsync_dir
from checkpoints.frameworks.commit import fsync_file, locked
from checkpoints.jit import JustInTimeTrigger
from checkpoints.protocol.jit import SKIPPED

__all__ = [
    "LAST_NAME",
    "LightningJustInTimeSave",
    "Outcome",
    "commit_last",
    "saved_step",
    "sharded_reason",
]

log = logging.getLogger(__name__)

#: The name ``fit(ckpt_path="last")`` finds in a ModelCheckpoint's directory.
LAST_NAME = "last.ckpt"
#: Strategies whose every rank holds the whole model and optimizer state.
_REPLICATED = ("DDPStrategy", "SingleDeviceStrategy")


class Outcome(str, enum.Enum):
    """What :func:`commit_last` did."""

    WRITTEN = "written"  # this rank's copy is last.ckpt now
    SAME = "same"  # last.ckpt already holds this step (another survivor's copy): kept
    NEWER = "newer"  # last.ckpt holds a newer step: nothing written


def sharded_reason(strategy: Any, optimizers: Sequence[Any] = ()) -> str | None:
    """Why the training state is sharded across ranks; None: every rank holds all of it."""
    name = type(strategy).__name__
    if name not in _REPLICATED:
        return f"the {name} strategy may shard the model or the optimizer across ranks"
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if hasattr(inner, "consolidate_state_dict"):
            return f"{type(inner).__name__} shards the optimizer state across ranks"
    return None


def saved_step(path: Path) -> int | None:
    """The ``global_step`` of the Lightning checkpoint at ``path`` (None: none, or unreadable).

    Reads the file through ``mmap`` with ``weights_only=True``: no tensor is read.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return int(checkpoint["global_step"])
    except Exception:  # missing, cut short, or holding types weights_only refuses
        return None


def commit_last(
    directory: Path,
    step: int,
    write: Callable[[Path], None],
    *,
    name: str = LAST_NAME,
    read_step: Callable[[Path], int | None] = saved_step,
) -> Outcome:
    """Make ``directory/name`` the checkpoint of ``step``, with no collective.

    Args:
        directory: the checkpoint directory.
        step: the step saved.
        write: writes the checkpoint to the path it is given.
        name: the file's name.
        read_step: the step of an existing checkpoint (None: unknown; it is replaced).

    Returns:
        What was done (:class:`Outcome`). Safe for several writers at once; never
        replaces a checkpoint of ``step`` or a newer one.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    temp = directory / f".{name}.tidal-{os.getpid()}-{time.monotonic_ns()}.tmp"
    try:
        write(temp)
        fsync_file(temp)
        with locked(directory):
            existing = read_step(final) if final.exists() else None
            if existing is not None and existing > step:
                return Outcome.NEWER
            if existing == step:
                return Outcome.SAME
            os.replace(temp, final)
            fsync_dir(directory)
            return Outcome.WRITTEN
    finally:
        temp.unlink(missing_ok=True)


class LightningJustInTimeSave(JustInTimeTrigger):
    """Saves Lightning's last completed step as ``last.ckpt`` when training fails.

    Made by the callback at ``on_train_start``.

    Args:
        trainer: the ``lightning.pytorch.Trainer``.
        directory: where ``last.ckpt`` goes.
        rank: this process's global rank (for the runner's report).
        local_rank: this process's rank on its node (only 0 writes).
        progress_dir: where the runner's notice and this rank's report live (None: no runner).
        exit_at_once: after the excepthook's save, end the process at once (``os._exit(1)``).
    """

    def __init__(
        self,
        *,
        trainer: Any,
        directory: Path,
        rank: int = 0,
        local_rank: int = 0,
        progress_dir: Path | None = None,
        exit_at_once: bool = True,
    ) -> None:
        # No optimizer hook: the callback calls mark_dirty (on_before_optimizer_step).
        super().__init__(optimizer=(), rank=rank, progress_dir=progress_dir,
                         exit_at_once=exit_at_once, thread_name="lightning-jit")
        self._trainer, self.directory, self._local_rank = trainer, directory, local_rank
        self._temp: Path | None = None
        #: True while Lightning's ``dump_checkpoint`` runs for this save (its hooks may ask).
        self.dumping = False
        #: What the save did (None: not saved, or nothing safe to save).
        self.outcome: Outcome | None = None

    def boundary(self, step: int) -> None:
        """``step`` optimizer steps are complete (``on_train_batch_end``): copy what changes."""
        trainer = self._trainer
        precision = trainer.precision_plugin
        self._record(step, {
            "epoch": trainer.current_epoch,
            "global_step": step,
            "loops": copy.deepcopy(trainer._checkpoint_connector._get_loops_state_dict()),
            "lr_schedulers": [copy.deepcopy(c.scheduler.state_dict())
                              for c in trainer.lr_scheduler_configs],
            "precision": (type(precision).__qualname__, copy.deepcopy(precision.state_dict())),
        })

    def _choose_step(self) -> tuple[int | None, str]:
        step, why = super()._choose_step()
        if step is not None and self._local_rank != 0:
            return None, "local rank 0 writes this node's copy"
        return step, why

    def checkpoint(self) -> dict[str, Any]:
        """Lightning's checkpoint of the recorded step (the lock is held: nothing changes)."""
        self.dumping = True
        try:
            checkpoint: dict[str, Any] = self._trainer._checkpoint_connector.dump_checkpoint(
                weights_only=False)
        finally:
            self.dumping = False
        small = self._small
        for key in ("epoch", "global_step", "loops", "lr_schedulers"):
            checkpoint[key] = small[key]
        name, state = small["precision"]
        if state:
            checkpoint[name] = state
        return checkpoint

    def _write(self, step: int, reason: str) -> Path | None:
        log.warning("just-in-time save of step %d as a Lightning checkpoint: %s", step, reason)
        checkpoint = self.checkpoint()

        def write(path: Path) -> None:
            self._temp = path
            torch.save(checkpoint, path)

        self.outcome = commit_last(self.directory, step, write)
        if self.outcome is Outcome.NEWER:
            log.warning("no just-in-time save of step %d: %s holds a newer step", step,
                        self.directory / LAST_NAME)
            self._report(SKIPPED, step=step, detail=f"{LAST_NAME} holds a newer step")
            return None
        return self.directory / LAST_NAME

    def _committed(self, step: int, path: Path, seconds: float) -> None:
        assert self.outcome is not None
        log.warning("just-in-time save of step %d %s %s in %.2f s", step,
                    "committed to" if self.outcome is Outcome.WRITTEN else "was already in",
                    path, seconds)

    def _written(self) -> int:
        """Bytes of the temporary file (the runner waits while this grows)."""
        for path in (self._temp, self.directory / LAST_NAME):
            try:
                return path.stat().st_size if path is not None else 0
            except OSError:  # renamed into place (or not there yet)
                continue
        return 0
