"""What a checkpoint holds, and the replicated (plain DDP) format that holds it.

The training state is one tree::

    {"step": int, "world_size": int, "model": ..., "optimizer": ..., "scheduler": ...,
     "scaler": ..., "rng": {"torch": ..., "cuda": [...], "python": ..., "numpy": ...},
     "extra": {...}}

For replicated state, rank 0 writes the whole tree with ``torch.save`` into
``state.pt``; every rank reads it back with ``torch.load(weights_only=True)``,
so a checkpoint can hold tensors and plain values but never code. The RNG
states are rank 0's; every rank restores them.
"""

from __future__ import annotations

import io
import logging
import pickle
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from checkpoints.errors import CheckpointCorruptError, CheckpointStateError, CheckpointWriteError
from checkpoints.files import CheckpointFileWriter, open_for_checkpoint
from checkpoints.storage import CheckpointStore, FileEntry, Manifest

__all__ = [
    "STATE_FILE",
    "Stateful",
    "apply_state",
    "capture_rng",
    "restore_rng",
    "safe_torch_load",
    "write_replicated",
]

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"


class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (scheduler, grad scaler)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def capture_rng() -> dict[str, Any]:
    """The random number generators' states of this process (torch, CUDA, random, numpy)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        rng["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # never imported just for this
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        rng["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured, skipping generators this process lacks."""
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(_tuples(rng["python"]))
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    numpy = sys.modules.get("numpy")
    saved = rng.get("numpy")
    if numpy is not None and saved is not None:
        keys = saved["keys"].numpy().astype("uint32")
        numpy.random.set_state(
            (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        )


def _tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    return value


def apply_state(
    state: dict[str, Any],
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    scaler: Stateful | None,
    path: Path,
) -> None:
    """Load a restored tree into the live objects (``model`` None: already loaded, sharded).

    Raises:
        CheckpointStateError: when the checkpoint does not fit them (another model, say).
    """
    parts: list[tuple[str, Any]] = [
        ("model", model),
        ("optimizer", optimizer),
        ("scheduler", scheduler),
        ("scaler", scaler),
    ]
    for name, target in parts:
        if target is None:
            continue
        if state.get(name) is None:
            log.warning("checkpoint %s holds no %s state; keeping the current one", path, name)
            continue
        try:
            target.load_state_dict(state[name])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointStateError(
                f"the {name} state in checkpoint {path} does not fit this {name}: {exc}"
            ) from exc
    if state.get("rng"):
        restore_rng(state["rng"])


def safe_torch_load(data: bytes | Path, *, path: Path, name: str, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` on CPU; anything it refuses is a corrupt checkpoint.

    Args:
        data: the file's bytes, or a path to load it from by name (``mmap``: memory-mapped).
        path / name: the checkpoint and the file's name in it, for the error.

    Raises:
        CheckpointCorruptError: naming the file and torch's reason.
    """
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorruptError(
            path, name, f"torch.load(weights_only=True) refused it: {reason}"
        ) from exc


def write_replicated(
    store: CheckpointStore,
    tree: dict[str, Any],
    *,
    step: int,
    world_size: int,
    started: float,
    epoch: int = 0,
    name: str | None = None,
    on_open: Callable[[CheckpointFileWriter], None] | None = None,
) -> tuple[Path, Manifest]:
    """Write ``tree`` as the checkpoint of ``step`` and commit it atomically.

    Args:
        store: where.
        tree: the state (tensors already snapshotted off the device, or
            live ones that nothing changes until this returns).
        step: completed steps.
        world_size: the job's world size when saving.
        started: ``time.monotonic()`` when the save began (for the manifest).
        epoch: the restore epoch of this run (the fence; see storage.Fence).
        name: the final directory name, if not the step's (a just-in-time candidate).
        on_open: called with the file writer before anything is written (its
            ``size`` grows as the save goes: a heartbeat reads it).

    Returns:
        The final path and the manifest.

    Raises:
        CheckpointWriteError: on any failure; the temporary directory is removed.
    """
    try:
        temp = store.new_temp_dir(step)
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot create a temporary directory under {store.root} for step {step}: {exc}"
        ) from exc
    try:
        with open_for_checkpoint(temp / STATE_FILE) as writer:
            if on_open is not None:
                on_open(writer)
            torch.save(tree, writer)  # type: ignore[arg-type]
        manifest = Manifest(
            step=step,
            world_size=world_size,
            kind="replicated",
            created=time.time(),
            files={STATE_FILE: FileEntry(size=writer.size, crc32=writer.crc32)},
            save_seconds=time.monotonic() - started,
            torch_version=torch.__version__,
            epoch=epoch,
        )
        return store.commit(temp, manifest, name=name), manifest
    except BaseException as exc:
        store.discard(temp)
        if isinstance(exc, CheckpointWriteError):
            raise
        if isinstance(exc, OSError | RuntimeError):
            raise CheckpointWriteError(
                f"writing the checkpoint of step {step} under {store.root} failed: {exc}"
            ) from exc
        raise
