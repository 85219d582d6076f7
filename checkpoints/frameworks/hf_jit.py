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

**No collective, several writers**: every survivor writes its own ``rng_state``
file and the first to commit puts the shared files in place; a complete
checkpoint of the same or a newer step is never overwritten
(:func:`checkpoints.frameworks.hf_checkpoint.commit_checkpoint`).

**Triggers**, as :mod:`checkpoints.jit` (:class:`checkpoints.jit.JustInTimeTrigger`):
a ``sys.excepthook`` saves when the exception that ends the process is a failed
collective; under tidal, a watcher thread also saves on the runner's ``peer-lost``
notice, with the ``saving-rank-<RANK>.json`` reports the runner waits on. After the
excepthook's save the process ends at once with exit code 1 (``os._exit``): the
interpreter's teardown of the broken group would otherwise block, up to the
collective timeout, on DDP's other gradient buckets.

Sharded state (FSDP, DeepSpeed) is held by no single rank: no just-in-time save
there (:func:`sharded_reason`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from checkpoints.frameworks.hf_checkpoint import (
    OPTIMIZER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
    WEIGHTS_NAMES,
    Outcome,
    checkpoint_name,
    commit_checkpoint,
    is_complete,
    newest_complete_step,
)
from checkpoints.jit import JustInTimeTrigger
from checkpoints.protocol.jit import SKIPPED

__all__ = [
    "HFJustInTimeSave",
    "Outcome",
    "checkpoint_name",
    "choose_step",
    "commit_checkpoint",
    "is_complete",
    "newest_complete_step",
    "save_model",
    "sharded_reason",
]

log = logging.getLogger(__name__)


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


# -------------------------------------------------------------------- the saver


def save_model(model: Any, directory: Path) -> None:
    """The model's files as ``Trainer._save`` writes them: ``save_pretrained`` (config and
    safetensors), or the bare state dict for a model without it.

    Whichever survivor commits writes them, on any rank: transformers 5.x's
    ``save_pretrained`` writes nothing on a rank other than torch.distributed's 0
    (``should_save_on_this_rank``), whatever ``is_main_process`` says, and rank 0 may be
    the rank that died or one whose optimizer step had begun. That check is lifted for
    this one call (an attribute on the instance, removed after). Should it still write no
    weights, the commit refuses the checkpoint (``IncompleteCheckpointError``).
    """
    if not hasattr(model, "save_pretrained"):
        import safetensors.torch

        safetensors.torch.save_file(model.state_dict(), str(directory / WEIGHTS_NAMES[0]),
                                    metadata={"format": "pt"})
        return
    lifted = hasattr(model, "should_save_on_this_rank")
    if lifted:
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(str(directory), is_main_process=True)
    finally:
        if lifted:
            del model.should_save_on_this_rank


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


class HFJustInTimeSave(JustInTimeTrigger):
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
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer that steps
        super().__init__(optimizer=inner, rank=rank, progress_dir=progress_dir,
                         exit_at_once=exit_at_once, thread_name="hf-jit")
        self._args, self._state, self._model = args, state, model
        self._optimizer, self._scheduler = optimizer, lr_scheduler
        self._scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer
        self._processing_class = processing_class
        self._local_rank = local_rank
        mode = getattr(getattr(args, "parallel_mode", None), "value", "")
        self._distributed = mode == "distributed"
        self._writing: Path | None = None  # the directory the shared files go to
        self._bytes = 0
        #: What the save did (None: not saved, or nothing safe to save).
        self.outcome: Outcome | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self._args.output_dir)

    @property
    def rng_name(self) -> str:
        """This rank's random-state file, as ``Trainer._save_rng_state`` names it."""
        if int(getattr(self._args, "world_size", 1) or 1) <= 1:
            return "rng_state.pth"
        return f"rng_state_{int(self._args.process_index)}.pth"

    def boundary(self, step: int) -> None:
        """``step`` optimizer steps are complete (``on_step_end``): remember what changes next."""
        self._record(step, {
            "rng": _rng_state(self._distributed),
            "scheduler": _state_dict_copy(self._scheduler),
            "scaler": _state_dict_copy(self._scaler),
        })

    def _choose_step(self) -> tuple[int | None, str]:
        return choose_step(self._step, dirty=self._dirty,
                           global_step=getattr(self._state, "global_step", None))

    def _write(self, step: int, reason: str) -> Path | None:
        log.warning("just-in-time save of step %d as a Trainer checkpoint: %s", step, reason)
        self.outcome = commit_checkpoint(
            self.output_dir, step, rng_name=self.rng_name, write_rng=self._write_rng,
            write_shared=self._write_shared if self._local_rank == 0 else None,
        )
        if self.outcome is Outcome.NEWER:
            log.warning("no just-in-time save of step %d: a newer complete checkpoint "
                        "exists in %s", step, self.output_dir)
            self._report(SKIPPED, step=step, detail="a newer checkpoint exists")
            return None
        return self.output_dir / checkpoint_name(step)

    def _committed(self, step: int, path: Path, seconds: float) -> None:
        assert self.outcome is not None
        log.warning("just-in-time save of step %d %s %s in %.2f s", step,
                    self.outcome.value, path, seconds)

    def _write_rng(self, path: Path) -> None:
        torch.save(self._small["rng"], path)

    def _write_shared(self, directory: Path) -> None:
        """The files ``Trainer._save_checkpoint`` writes once per checkpoint (DDP or one device)."""
        self._writing = directory
        save_model(self._model, directory)
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
