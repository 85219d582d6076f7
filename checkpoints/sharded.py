"""Sharded state (FSDP2 / DTensor) through torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model and optimizer with DCP into the
checkpoint's temporary directory; DCP records the global layout, so a
checkpoint saved at one world size loads at another (it reshards on load).
Everything that is not sharded (step, scheduler, grad scaler, RNG, user
extras) goes into ``replicated.pt``, written by rank 0 with ``torch.save``.
Rank 0 then checksums every file, writes the manifest and renames the
directory, exactly as for replicated checkpoints (see checkpoints/storage.py).

DCP runs its collectives on a private gloo group, never on the training group:
an asynchronous save's background collectives interleaving with the training
loop's have deadlocked other projects. DCP reads its ``.metadata`` file with
plain ``pickle``; :class:`SafeFileSystemReader` reads it with an unpickler
that only admits DCP's own metadata classes and torch's dtypes, so a sharded
checkpoint cannot run code either.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpoints.errors import CheckpointCorruptError, CheckpointStateError
from checkpoints.files import file_crc32, open_for_checkpoint
from checkpoints.state import safe_torch_load
from checkpoints.storage import MANIFEST_NAME, CheckpointStore, FileEntry, Manifest

__all__ = [
    "REPLICATED_FILE",
    "SafeFileSystemReader",
    "commit_sharded",
    "load_sharded",
    "sharded_state",
    "start_sharded_save",
]

log = logging.getLogger(__name__)

REPLICATED_FILE = "replicated.pt"
_DCP_MODULE = "torch.distributed.checkpoint."
# Besides DCP's classes and torch's dtypes: what .metadata pickles refer to. torch's
# own weights_only unpickler admits the same (_get_layout maps a name to a layout).
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # storage_meta.checkpoint_id; constructing one runs nothing
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP metadata classes and torch's Size/dtype/layout/memory_format."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_MODULE) and (module + ".").count(".") <= 5:
            value = super().find_class(module, name)
            if isinstance(value, type):
                return value
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(
                value, torch.dtype | torch.layout | torch.memory_format
            ):
                return value
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):  # type: ignore[misc]
    """DCP's FileSystemReader, reading ``.metadata`` without executing arbitrary pickles."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """Read the metadata with a restricted unpickler.

        Raises:
            CheckpointCorruptError: when it refers to anything but DCP metadata types.
        """
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise CheckpointCorruptError(Path(self.path), ".metadata", str(exc)) from exc
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """The model's (and optimizer's) sharded state dict, keyed by parameter name."""
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [], options=StateDictOptions())
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def start_sharded_save(
    state: Any, temp_dir: Path, *, group: dist.ProcessGroup | None, use_async: bool
) -> Future[Any] | None:
    """Save this rank's shards into ``temp_dir`` (collective over ``group``).

    Returns:
        A future when ``use_async`` (state already staged off the device), else None.
    """
    writer = FileSystemWriter(str(temp_dir), sync_files=True)
    if use_async:
        future = dcp_async_save(state, storage_writer=writer, process_group=group)
        return future  # type: ignore[return-value]
    dcp_save(state, storage_writer=writer, process_group=group)
    return None


def commit_sharded(
    store: CheckpointStore,
    temp_dir: Path,
    replicated: dict[str, Any],
    *,
    step: int,
    world_size: int,
    started: float,
    epoch: int = 0,
) -> tuple[Path, Manifest]:
    """Rank 0, once every rank's shards are written: add ``replicated.pt``, checksum, commit."""
    with open_for_checkpoint(temp_dir / REPLICATED_FILE) as writer:
        torch.save(replicated, writer)  # type: ignore[arg-type]
    files = {REPLICATED_FILE: FileEntry(size=writer.size, crc32=writer.crc32)}
    for entry in sorted(os.listdir(temp_dir)):
        if entry not in files and entry != MANIFEST_NAME:
            size, crc = file_crc32(temp_dir / entry)
            files[entry] = FileEntry(size=size, crc32=crc)
    manifest = Manifest(
        step=step,
        world_size=world_size,
        kind="sharded",
        created=time.time(),
        files=files,
        save_seconds=time.monotonic() - started,
        torch_version=torch.__version__,
        epoch=epoch,
    )
    return store.commit(temp_dir, manifest), manifest


def load_sharded(
    store: CheckpointStore,
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
    checksums: bool,
) -> tuple[Manifest, dict[str, Any]]:
    """Verify a sharded checkpoint, load the shards into ``model``/``optimizer`` (collective).

    Returns:
        The manifest and the replicated part of the state.

    Raises:
        CheckpointCorruptError: when verification or DCP's load fails.
        CheckpointStateError: when the shards do not fit the model.
    """
    manifest = store.verify(path, checksums=checksums)
    if manifest.kind != "sharded":
        raise CheckpointCorruptError(path, None, f"it is {manifest.kind}, not sharded")
    replicated = safe_torch_load(
        store.read_verified(path, manifest, REPLICATED_FILE), path=path, name=REPLICATED_FILE
    )
    target = sharded_state(model, optimizer)
    try:
        dcp_load(target, storage_reader=SafeFileSystemReader(str(path)), process_group=group)
    except CheckpointCorruptError:
        raise
    except Exception as exc:
        raise CheckpointStateError(f"loading the shards of {path} failed: {exc}") from exc
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=target["model"], optim_state_dict={})
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=target["model"],
            optim_state_dict=target["optimizer"],
        )
    return manifest, replicated
