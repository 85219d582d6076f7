"""The Hugging Face Trainer's checkpoint layout, and its commit by several survivors at once.

A Trainer checkpoint is a directory ``checkpoint-<step>`` in ``args.output_dir``
(transformers 5.x's ``_save_checkpoint``): the model through ``save_pretrained``
(safetensors and config), ``training_args.bin``, ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt`` (when there is a grad scaler),
``rng_state_<process_index>.pth`` (``rng_state.pth`` for one process) and
``trainer_state.json``, written last: a directory without it is incomplete.

**No collective, several writers.** The group is broken, so nobody agrees on
a writer: every survivor writes its own ``rng_state`` file, and the first to
commit puts the shared files in place (:func:`commit_checkpoint`): they are
written to a hidden temporary directory (``.checkpoint-<step>.tidal-*``, which
``get_last_checkpoint`` and the Trainer's rotation never match), fsynced and
renamed to ``checkpoint-<step>``; a later survivor finds it complete and adds
only its ``rng_state`` file (temporary file, rename). Shared files without the
weights or the trainer state are never put in place (:class:`IncompleteCheckpointError`):
``get_last_checkpoint`` would pick them and the Trainer refuse them. The commits are
serialized by an ``flock`` on ``<output_dir>/.tidal-jit.lock`` (released by the
kernel if the holder dies). A complete checkpoint of the same or a newer step
is never overwritten; an incomplete ``checkpoint-<step>`` (a Trainer save cut
short) has its files replaced one by one, ``trainer_state.json`` last. Only
local rank 0 of a node writes the shared files (one copy per node, as the
Checkpointer); the node's other ranks add their ``rng_state`` file, parked in
``.checkpoint-<step>.tidal-rng`` until the shared files are in place.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from checkpoints.files import fsync_dir
from checkpoints.frameworks.commit import add_file, fsync_file, locked

__all__ = [
    "OPTIMIZER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "TRAINER_STATE_NAME",
    "TRAINING_ARGS_NAME",
    "WEIGHTS_NAMES",
    "IncompleteCheckpointError",
    "Outcome",
    "checkpoint_name",
    "commit_checkpoint",
    "is_complete",
    "newest_complete_step",
]

# transformers' file names (trainer.py, utils/__init__.py), kept here so that
# nothing needs transformers imported to write or check a checkpoint.
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
WEIGHTS_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint


class IncompleteCheckpointError(RuntimeError):
    """The shared files a commit was given lack the weights or the trainer state."""


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
    return (path / TRAINER_STATE_NAME).is_file() and any(
        (path / w).is_file() for w in WEIGHTS_NAMES)


def newest_complete_step(output_dir: Path) -> int | None:
    """The newest step with a complete ``checkpoint-<step>`` in ``output_dir`` (None: none)."""
    steps = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(output_dir):
            match = _CHECKPOINT.match(entry.name)
            if match and entry.is_dir() and is_complete(Path(entry.path)):
                steps.append(int(match.group(1)))
    return max(steps, default=None)


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
        with locked(output_dir):
            if _newer(output_dir, step):
                return Outcome.NEWER
            if is_complete(final):
                add_file(final, rng_name, write_rng)
                return Outcome.JOINED
            if write_shared is None:
                target = final if final.is_dir() else _parked(output_dir, step)
                add_file(target, rng_name, write_rng)
                return Outcome.PARKED if target != final else Outcome.JOINED
            if temp is None:  # it was complete and is no longer (rotated away): write it now
                temp = _write_temp(output_dir, step, rng_name, write_rng, write_shared)
            try:
                os.rename(temp, final)  # fails if a non-empty checkpoint-<step> exists
            except OSError:
                _replace_files(temp, final)  # an incomplete one: ours, file by file
            else:
                temp = None  # renamed into place: nothing left to remove
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
        if not is_complete(temp):  # never put in place what resuming would refuse
            raise IncompleteCheckpointError(
                f"the shared files of {checkpoint_name(step)} came out incomplete: "
                f"{TRAINER_STATE_NAME} and one of {', '.join(WEIGHTS_NAMES)} are needed, "
                f"written were {', '.join(sorted(p.name for p in temp.iterdir()))}")
        for path in temp.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return temp


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
