"""tidal for the Hugging Face ``transformers.Trainer``: one line, ``callbacks=[TidalCallback()]``.

Tested with transformers 5.24 (and accelerate 1.15), torch 2.13, on CPU with gloo.

What the callback gives a ``Trainer`` (docs/frameworks.md):

* **Progress and pace**: the step (``state.global_step``), the loss (from
  ``on_log``), the total (``state.max_steps``) and samples per step go to the
  node agent through :func:`checkpoints.progress.create_progress_reporter` (a
  no-op outside tidal); :class:`checkpoints.pace.PaceMeter` times the rank's
  own work on the model (the stragglers' input).
* **One agreed stop on SIGTERM**: the signal only sets a flag; at each step's
  end the ranks agree on it with an all-reduce on a private gloo group, one
  step late, so every rank sets ``control.should_save`` and
  ``control.should_training_stop`` at the same step. The Trainer then writes
  its own ``checkpoint-<step>`` (model, optimizer, scheduler, RNG, trainer
  state), which ``trainer.train(resume_from_checkpoint=True)`` resumes; once
  every rank's part is written the process exits with
  :data:`checkpoints.EXIT_PREEMPTED` (75), as the Checkpointer does
  (``exit_on_stop=False``: ``train()`` returns instead, and
  :attr:`stop_requested` says why).

* **The just-in-time save when a peer dies** (:mod:`checkpoints.frameworks.hf_jit`):
  when ``train()`` ends in a failed collective, each survivor writes the last
  completed step as ``checkpoint-<step>`` in ``args.output_dir``, in the
  Trainer's own layout, with no collective (several survivors may write at
  once; a complete checkpoint is never overwritten), so
  ``trainer.train(resume_from_checkpoint=True)`` loses at most the step in
  flight. Only for replicated state (DDP, one device): under FSDP or DeepSpeed
  it logs why and does nothing. ``jit_save=False`` or ``TIDAL_JIT_SAVE=0``
  turns it off.

What it does not do: the live path for planned changes and for failures. The
training loop holds the DDP wrapper in a local variable, accelerate's
``PartialState`` singleton holds the world size and the rank, and the data
loader is split by them once per ``train()``: a callback can re-form the
process group but not rebuild those (docs/frameworks.md, "The live path: where
it does not hold", with a probe). So the callback never declares the job
live-capable: a join, a PATCH or a drain takes the restart path, cleanly (the
agreed stop loses no completed step), and a peer's death restarts the
survivors (after their just-in-time save).

``transformers`` is imported when :class:`TidalCallback` is first used, never
by importing :mod:`checkpoints`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints.frameworks.boundary import StepBoundary
from checkpoints.frameworks.hf_jit import HFJustInTimeSave, sharded_reason
from checkpoints.jit import JIT_ENV
from checkpoints.progress import PROGRESS_DIR_ENV, ProgressReporter
from checkpoints.signals import EXIT_PREEMPTED

__all__ = ["TESTED_WITH", "TidalCallback"]

if TYPE_CHECKING:
    #: ``transformers.TrainerCallback`` with :class:`_Hooks` mixed in (made on first use).
    TidalCallback: type

log = logging.getLogger(__name__)

#: The versions this module is tested with (lower bounds in pyproject's test extras).
TESTED_WITH = {"transformers": "5.24", "accelerate": "1.15"}


class _Hooks:
    """The callback's behaviour; :func:`_callback_class` mixes it into ``TrainerCallback``.

    Args:
        progress: where progress goes (default: the agent's progress directory, if any).
        handle_sigterm: turn SIGTERM into an agreed stop with a Trainer checkpoint.
        exit_on_stop: after that checkpoint, exit with ``EXIT_PREEMPTED``
            (False: stop training and let ``train()`` return).
        sigterm_grace_seconds: after SIGTERM, exit at once if still running this long.
        jit_save: when training ends in a failed collective (a peer died), write
            the last completed step as a Trainer checkpoint
            (:mod:`checkpoints.frameworks.hf_jit`). ``TIDAL_JIT_SAVE=0`` in the
            environment turns it off too.
    """

    def __init__(
        self,
        *,
        progress: ProgressReporter | None = None,
        handle_sigterm: bool = True,
        exit_on_stop: bool = True,
        sigterm_grace_seconds: float = 60.0,
        jit_save: bool = True,
    ) -> None:
        self.boundary = StepBoundary(
            progress=progress, handle_sigterm=handle_sigterm,
            sigterm_grace_seconds=sigterm_grace_seconds,
        )
        self._exit_on_stop = exit_on_stop
        self._jit_wanted = jit_save
        #: The just-in-time save of this run (None: off, sharded, or not training).
        self.jit: HFJustInTimeSave | None = None

    @property
    def stop_requested(self) -> bool:
        """Whether the ranks agreed to stop on SIGTERM (training stopped at :attr:`stop_step`)."""
        return self.boundary.stop_step is not None

    @property
    def stop_step(self) -> int | None:
        """The step every rank stopped at, after SIGTERM."""
        return self.boundary.stop_step

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start reporting and timing; handle SIGTERM (collective: makes a gloo group)."""
        world = max(1, int(getattr(args, "world_size", 1) or 1))
        per_step = (int(args.per_device_train_batch_size)
                    * int(args.gradient_accumulation_steps) * world)
        self.boundary.begin(
            kwargs.get("model"), total_steps=int(state.max_steps or 0) or None,
            samples_per_step=per_step,
        )
        self._arm_jit(args, state, kwargs)

    def _arm_jit(self, args: Any, state: Any, kwargs: dict[str, Any]) -> None:
        if self.jit is not None:
            self.jit.disarm()
            self.jit = None
        if not self._jit_wanted or os.environ.get(JIT_ENV) == "0":
            return
        sharded = sharded_reason(args)
        if sharded is not None:
            log.warning("no just-in-time save for this Trainer: %s (a failure costs the steps "
                        "since its last checkpoint)", sharded)
            return
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            log.warning("no just-in-time save: the Trainer gave the callback no model or optimizer")
            return
        progress_dir = os.environ.get(PROGRESS_DIR_ENV)
        self.jit = HFJustInTimeSave(
            args=args, state=state, model=model, optimizer=optimizer,
            lr_scheduler=kwargs.get("lr_scheduler"),
            processing_class=kwargs.get("processing_class"),
            rank=self.boundary.rank, local_rank=int(getattr(args, "local_process_index", 0) or 0),
            progress_dir=Path(progress_dir) if progress_dir else None,
        )
        self.jit.arm()

    def save_after_failure(self, exc: BaseException) -> Path | None:
        """For a script that catches ``train()``'s exception: the just-in-time save, if it applies.

        Returns:
            The checkpoint's directory, or None (not a failed collective, off,
            or nothing safe to save).
        """
        return self.jit.save_if_collective_failure(exc) if self.jit is not None else None

    def _disarm_jit(self) -> None:
        if self.jit is not None:
            self.jit.disarm()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        """Keep the latest training loss."""
        if isinstance(logs, dict) and "loss" in logs:
            self.boundary.note_loss(logs["loss"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the step; when every rank agrees to stop, ask the Trainer to save and stop."""
        if self.jit is not None:
            self.jit.boundary(int(state.global_step))  # before any collective of ours can fail
        if self.boundary.step_end(int(state.global_step)):
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the checkpoint; after the stop's checkpoint, wait for every rank, then exit."""
        step = int(state.global_step)
        self.boundary.saved(step)
        if self.boundary.stop_step != step:
            return
        self.boundary.finish_stop()
        log.warning("checkpoint-%d written on every rank after SIGTERM", step)
        if self._exit_on_stop:
            self._disarm_jit()
            self.boundary.end()
            raise SystemExit(EXIT_PREEMPTED)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Stop handling SIGTERM; write a last report (collective: drains the flags)."""
        self._disarm_jit()
        self.boundary.end()


_CLASSES: dict[str, type] = {}


def _callback_class() -> type:
    """``TidalCallback``: :class:`_Hooks` on ``transformers.TrainerCallback`` (made once)."""
    cls = _CLASSES.get("TidalCallback")
    if cls is None:
        from transformers import TrainerCallback  # type: ignore[import-not-found,unused-ignore]

        cls = type("TidalCallback", (_Hooks, TrainerCallback), {
            "__doc__": _Hooks.__doc__, "__module__": __name__,
        })
        _CLASSES["TidalCallback"] = cls
    return cls


def __getattr__(name: str) -> Any:
    """``TidalCallback`` is made on first use: importing this module needs no transformers."""
    if name == "TidalCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
