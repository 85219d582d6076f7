"""tidal for Lightning: ``plugins=[TidalEnvironment()]`` and ``callbacks=[TidalCallback()]``.

Tested with lightning 2.6 (the ``lightning`` package, not ``pytorch_lightning``),
torch 2.13, on CPU with gloo.

* :class:`TidalEnvironment` (a ``ClusterEnvironment``) takes the world size and
  the ranks from the torchrun-style environment tidal's runner sets (``WORLD_SIZE``,
  ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``). Lightning's own ``TorchElasticEnvironment`` insists that
  ``devices * num_nodes`` equals ``WORLD_SIZE``, so a ``Trainer(strategy="ddp")``
  written without ``num_nodes`` fails on more than one node, and one written
  with it fails after any resize. This one checks only what a node decides
  (``devices`` against ``LOCAL_WORLD_SIZE``).
* :class:`TidalCallback` sets the strategy's ``num_nodes`` from the environment
  (the distributed sampler's ``num_replicas`` is ``num_nodes * devices``),
  reports progress and pace (as the Checkpointer does), and replaces Lightning's
  SIGTERM handler, which runs a ``dist.broadcast`` inside the signal handler
  and hangs when the ranks get the signal at different points. The signal only
  sets a flag; the ranks agree on it at a step's end (an all-reduce on a
  private gloo group, one step late), every rank writes the checkpoint of that
  same step with ``trainer.save_checkpoint`` as ``last.ckpt`` in the
  ``ModelCheckpoint``'s directory (so ``fit(ckpt_path="last")`` resumes it),
  and the process exits with :data:`checkpoints.EXIT_PREEMPTED` (75).
* **The just-in-time save when a peer dies** (:mod:`checkpoints.frameworks.lightning_jit`):
  when ``fit`` fails in a collective, each survivor writes the last completed
  step as ``last.ckpt`` in the same directory, in Lightning's own format and with
  no collective (a checkpoint of that step or a newer one is never overwritten),
  so ``fit(ckpt_path="last")`` loses at most the step in flight. Only for
  replicated state (DDP, one device): under FSDP, DeepSpeed or a
  ``ZeroRedundancyOptimizer`` it logs why and does nothing. ``jit_save=False``
  or ``TIDAL_JIT_SAVE=0`` turns it off.

Not done: the live path. A callback can re-form the process group and re-wrap
DDP (the strategy reads its ``model`` each step), but the fit loop's
``DistributedSampler`` and its iterator are built once per ``fit()`` with the
old world size and rank, the ranks are cached in the cluster environment and
``rank_zero_only``, and a joining process cannot enter a running ``fit()``
(docs/frameworks.md, "The live path: where it does not hold", with a probe).
So the callback never declares the job live-capable: a join, a PATCH or a
drain takes the restart path (cleanly: the agreed stop loses no completed
step), and a peer's death restarts the survivors after their just-in-time save.

``lightning`` is imported when a class here is first used, never by importing
:mod:`checkpoints`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints.frameworks.boundary import StepBoundary
from checkpoints.frameworks.lightning_jit import LAST_NAME, LightningJustInTimeSave, sharded_reason
from checkpoints.jit import JIT_ENV
from checkpoints.progress import PROGRESS_DIR_ENV, ProgressReporter
from checkpoints.signals import EXIT_PREEMPTED

__all__ = ["TESTED_WITH", "TidalCallback", "TidalEnvironment", "nodes_from_env"]

if TYPE_CHECKING:
    #: ``lightning.pytorch.Callback`` with :class:`_Hooks` mixed in (made on first use).
    TidalCallback: type
    #: ``lightning.fabric.plugins.environments.ClusterEnvironment`` reading tidal's env.
    TidalEnvironment: type

log = logging.getLogger(__name__)

#: The versions this module is tested with (lower bounds in pyproject's test extras).
TESTED_WITH = {"lightning": "2.6"}


def nodes_from_env(environ: Mapping[str, str] | None = None) -> int:
    """How many nodes the job has now: ``WORLD_SIZE // LOCAL_WORLD_SIZE`` (1 when unset).

    Raises:
        ValueError: when ``WORLD_SIZE`` is not a multiple of ``LOCAL_WORLD_SIZE``.
    """
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if local < 1 or world % local:
        raise ValueError(
            f"WORLD_SIZE ({world}) is not a multiple of LOCAL_WORLD_SIZE ({local})")
    return world // local


class _Environment:
    """Torchrun-style environment, as tidal's runner sets it; mixed into ``ClusterEnvironment``."""

    @property
    def creates_processes_externally(self) -> bool:
        """tidal's runner starts the processes, never Lightning."""
        return True

    @property
    def main_address(self) -> str:
        """``MASTER_ADDR``."""
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``."""
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        """Whether the torchrun-style variables are set."""
        return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))

    def world_size(self) -> int:
        """``WORLD_SIZE``."""
        return int(os.environ["WORLD_SIZE"])

    def set_world_size(self, size: int) -> None:
        """Ignored: the world size is the job's, not Lightning's to set."""

    def global_rank(self) -> int:
        """``RANK``."""
        return int(os.environ["RANK"])

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the rank is the rendezvous's, not Lightning's to set."""

    def local_rank(self) -> int:
        """``LOCAL_RANK``."""
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        """``GROUP_RANK`` (torch elastic's rank of this node's agent)."""
        return int(os.environ.get("GROUP_RANK", "0"))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check ``devices`` against ``LOCAL_WORLD_SIZE``; ``num_nodes`` is the job's to say.

        Raises:
            ValueError: when the Trainer's ``devices`` differs from the processes per node.
        """
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) != num_devices:
            raise ValueError(
                f"the Trainer's devices ({num_devices}) is not the number of processes tidal "
                f"starts on this node (LOCAL_WORLD_SIZE={local}): set devices={local} or 'auto'")
        nodes = nodes_from_env()
        if num_nodes != nodes:
            log.info("num_nodes (%d) is not this job's node count (%d); TidalCallback sets it",
                     num_nodes, nodes)


class _Hooks:
    """The callback's behaviour; mixed into ``lightning.pytorch.Callback`` on first use.

    Args:
        progress: where progress goes (default: the agent's progress directory, if any).
        handle_sigterm: replace Lightning's SIGTERM handler with an agreed stop.
        exit_on_stop: after the stop's checkpoint, exit with ``EXIT_PREEMPTED``
            (False: set ``trainer.should_stop`` and let ``fit`` return).
        dirpath: where the stop's and the just-in-time save's ``last.ckpt`` goes
            (default: the first ``ModelCheckpoint``'s directory, else
            ``<default_root_dir>/checkpoints``).
        sigterm_grace_seconds: after SIGTERM, exit at once if still running this long.
        jit_save: when ``fit`` fails in a collective (a peer died), write the last
            completed step as ``last.ckpt`` (:mod:`checkpoints.frameworks.lightning_jit`).
            ``TIDAL_JIT_SAVE=0`` in the environment turns it off too.
    """

    def __init__(
        self,
        *,
        progress: ProgressReporter | None = None,
        handle_sigterm: bool = True,
        exit_on_stop: bool = True,
        dirpath: str | os.PathLike[str] | None = None,
        sigterm_grace_seconds: float = 60.0,
        jit_save: bool = True,
    ) -> None:
        self.boundary = StepBoundary(
            progress=progress, handle_sigterm=handle_sigterm,
            sigterm_grace_seconds=sigterm_grace_seconds,
        )
        self._exit_on_stop = exit_on_stop
        self._dirpath = dirpath
        self._last_step = -1
        self._jit_wanted = jit_save
        #: The just-in-time save of this run (None: off, sharded, or not training).
        self.jit: LightningJustInTimeSave | None = None
        #: The checkpoint written at the agreed stop, if any.
        self.stop_path: Path | None = None

    @property
    def stop_step(self) -> int | None:
        """The step every rank stopped at, after SIGTERM."""
        return self.boundary.stop_step

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Give the strategy the job's node count (its sampler splits the data by it)."""
        strategy = trainer.strategy
        if stage == "fit" and hasattr(strategy, "num_nodes") and "WORLD_SIZE" in os.environ:
            nodes = nodes_from_env()
            if strategy.num_nodes != nodes:
                strategy.num_nodes = nodes
                if hasattr(strategy, "set_world_ranks"):
                    strategy.set_world_ranks()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start reporting and timing; take SIGTERM over from Lightning (collective)."""
        # Lightning registered its handler just before this hook (Trainer._run):
        # installing ours now replaces it for the whole fit; its teardown puts
        # back what was there before fit.
        per_step = None
        batch = getattr(getattr(trainer, "train_dataloader", None), "batch_size", None)
        if isinstance(batch, int):
            per_step = batch * int(trainer.accumulate_grad_batches) * int(trainer.world_size)
        total = int(trainer.max_steps) if int(trainer.max_steps) > 0 else None
        self.boundary.begin(pl_module, total_steps=total, samples_per_step=per_step)
        self._last_step = int(trainer.global_step)
        self._arm_jit(trainer)

    def _arm_jit(self, trainer: Any) -> None:
        self._disarm_jit()
        if not self._jit_wanted or os.environ.get(JIT_ENV) == "0":
            return
        sharded = sharded_reason(trainer.strategy, trainer.optimizers)
        if sharded is not None:
            log.warning("no just-in-time save for this Trainer: %s (a failure costs the steps "
                        "since its last checkpoint)", sharded)
            return
        progress_dir = os.environ.get(PROGRESS_DIR_ENV)
        self.jit = LightningJustInTimeSave(
            trainer=trainer, directory=self._stop_dir(trainer), rank=int(trainer.global_rank),
            local_rank=int(trainer.local_rank),
            progress_dir=Path(progress_dir) if progress_dir else None,
        )
        self.jit.arm()

    def _disarm_jit(self) -> None:
        if self.jit is not None:
            self.jit.disarm()
            self.jit = None

    def save_after_failure(self, exc: BaseException) -> Path | None:
        """The just-in-time save, if ``exc`` is a failed collective (``on_exception`` calls it).

        Returns:
            ``last.ckpt``'s path, or None (not a failed collective, off, or
            nothing safe to save).
        """
        return self.jit.save_if_collective_failure(exc) if self.jit is not None else None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """``fit`` failed: if a collective did (a peer died), save the last completed step."""
        self.save_after_failure(exception)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After an optimizer step: report it; on an agreed stop, save on every rank and exit."""
        step = int(trainer.global_step)
        if step == self._last_step:  # gradient accumulation: no optimizer step yet
            return
        self._last_step = step
        if self.jit is not None:
            self.jit.boundary(step)  # before any collective of ours can fail
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not self.boundary.step_end(step, loss=loss):
            return
        path = self._stop_dir(trainer) / LAST_NAME
        trainer.save_checkpoint(str(path))  # collective: rank 0 writes, the strategy barriers
        self.stop_path = path
        self.boundary.saved(step)
        self.boundary.finish_stop()
        log.warning("%s written at step %d on every rank after SIGTERM", path, step)
        if self._exit_on_stop:
            self._disarm_jit()
            self.boundary.end()
            raise SystemExit(EXIT_PREEMPTED)
        trainer.should_stop = True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The parameters are about to change: the last completed step is no longer live."""
        if self.jit is not None:
            self.jit.mark_dirty()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        """Report Lightning's own checkpoints to the agent too (not the just-in-time save's)."""
        if self.jit is not None and self.jit.dumping:
            return  # another thread's save, while the step in flight has failed
        self.boundary.saved(int(trainer.global_step))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Give SIGTERM back; write a last report (collective: drains the flags)."""
        self._disarm_jit()
        self.boundary.end()

    def _stop_dir(self, trainer: Any) -> Path:
        if self._dirpath is not None:
            return Path(self._dirpath)
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None):
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"


_CLASSES: dict[str, type] = {}


def _make(name: str) -> type:
    cls = _CLASSES.get(name)
    if cls is not None:
        return cls
    if name == "TidalCallback":
        from lightning.pytorch import Callback  # type: ignore[import-not-found,unused-ignore]

        cls = type(name, (_Hooks, Callback), {"__doc__": _Hooks.__doc__, "__module__": __name__})
    else:
        from lightning.fabric.plugins.environments import (  # type: ignore[attr-defined,import-not-found,unused-ignore]
            ClusterEnvironment,
        )

        cls = type(name, (_Environment, ClusterEnvironment),
                   {"__doc__": _Environment.__doc__, "__module__": __name__})
    _CLASSES[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    """The Lightning classes are made on first use: importing this module needs no lightning."""
    if name in ("TidalCallback", "TidalEnvironment"):
        return _make(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
