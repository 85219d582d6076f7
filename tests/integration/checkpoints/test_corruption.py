"""A damaged or malicious newest checkpoint: restore falls back to the previous one and says why.

Real checkpoints are written with the library, then a file of the newest is
truncated, zeroed or deleted, or the newest is replaced by a crafted one whose
pickle would run code. Restore must pick the previous good checkpoint, log the
file and the reason, move the bad one aside, and never run the payload.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoints as ck
from checkpoints.files import file_crc32
from checkpoints.sharded import SafeFileSystemReader
from checkpoints.storage import MANIFEST_NAME, CheckpointStore, FileEntry, Manifest


def make_job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return model, torch.optim.Adam(model.parameters())


def write_two(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of steps 2 and 4; returns the model state at each."""
    model, optimizer = make_job()
    states = {}
    with ck.Checkpointer(root, model=model, optimizer=optimizer, handle_sigterm=False) as ckpt:
        for step in (2, 4):
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def restore(root: Path) -> tuple[ck.Resume, torch.nn.Module]:
    model, optimizer = make_job(seed=1)
    with ck.Checkpointer(root, model=model, optimizer=optimizer, handle_sigterm=False) as ckpt:
        return ckpt.restore(), model


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def zero(path: Path) -> None:
    path.write_bytes(b"\0" * path.stat().st_size)


@pytest.mark.parametrize(
    ("name", "damage", "reason"),
    [
        ("state.pt", truncate, "bytes but the manifest says"),
        ("state.pt", zero, "CRC-32"),
        ("state.pt", Path.unlink, "it is missing"),
        (MANIFEST_NAME, truncate, "not valid JSON"),
        (MANIFEST_NAME, Path.unlink, "it is missing"),
    ],
    ids=["truncate-state", "zero-state", "delete-state", "truncate-manifest", "delete-manifest"],
)
def test_restore_falls_back_to_the_previous_checkpoint_and_names_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, damage: Any, reason: str
) -> None:
    states = write_two(tmp_path)
    newest = tmp_path / "step-0000000004"
    damage(newest / name)
    caplog.set_level(logging.WARNING, logger="checkpoints")
    resume, model = restore(tmp_path)
    assert resume.step == 2 and resume.path == tmp_path / "step-0000000002"
    torch.testing.assert_close(model.state_dict(), states[2], rtol=0, atol=0)
    assert f"{newest}/{name} is unusable: " in caplog.text
    assert reason in caplog.text
    assert "falling back to an older checkpoint" in caplog.text
    # The bad one is out of the final names, kept for inspection.
    assert CheckpointStore(tmp_path).steps() == [2]
    assert any(p.name.startswith(".invalid-step-0000000004-") for p in tmp_path.iterdir())


def test_with_every_checkpoint_damaged_the_job_starts_fresh(tmp_path: Path) -> None:
    write_two(tmp_path)
    for step in (2, 4):
        zero(tmp_path / f"step-{step:010d}" / "state.pt")
    resume, _ = restore(tmp_path)
    assert resume.fresh and resume.step == 0


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def plant(root: Path, step: int, name: str, data: bytes) -> Path:
    """A checkpoint whose manifest matches its content: only its payload is bad."""
    path = root / f"step-{step:010d}"
    path.mkdir()
    (path / name).write_bytes(data)
    size, crc = file_crc32(path / name)
    manifest = Manifest(
        step=step,
        world_size=1,
        kind="replicated",
        created=0.0,
        files={name: FileEntry(size=size, crc32=crc)},
    )
    (path / MANIFEST_NAME).write_text(manifest.to_json())
    return path


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_and_never_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    states = write_two(tmp_path)
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"step": 6, "model": Payload(marker)}, evil)
    plant(tmp_path, 6, "state.pt", evil.read_bytes())
    caplog.set_level(logging.WARNING, logger="checkpoints")
    resume, model = restore(tmp_path)
    assert not marker.exists()
    assert resume.step == 4
    torch.testing.assert_close(model.state_dict(), states[4], rtol=0, atol=0)
    assert "step-0000000006/state.pt is unusable: torch.load(weights_only=True) refused it" in (
        caplog.text
    )


def test_sharded_metadata_carrying_a_pickle_payload_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ck.CheckpointCorruptError, match="not allowed"):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not marker.exists()
