"""The on-disk layout: manifest, atomic commit, verification, keep-K, stale-entry cleanup."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from checkpoints.errors import CheckpointCorruptError
from checkpoints.files import open_for_checkpoint
from checkpoints.storage import (
    MANIFEST_NAME,
    CheckpointStore,
    FileEntry,
    Manifest,
    checkpoint_name,
)


def write_checkpoint(store: CheckpointStore, step: int, payload: bytes = b"x" * 1000) -> Path:
    temp = store.new_temp_dir(step)
    with open_for_checkpoint(temp / "state.pt") as writer:
        writer.write(payload)
    manifest = Manifest(
        step=step,
        world_size=2,
        kind="replicated",
        created=1.5,
        files={"state.pt": FileEntry(size=writer.size, crc32=writer.crc32)},
    )
    return store.commit(temp, manifest)


def test_checkpoint_names_sort_by_step_and_reject_negative_steps() -> None:
    assert checkpoint_name(40) == "step-0000000040"
    names = [checkpoint_name(10), checkpoint_name(9)]
    assert sorted(names) == ["step-0000000009", "step-0000000010"]
    with pytest.raises(ValueError, match=r"step \(-1\)"):
        checkpoint_name(-1)


def test_manifest_round_trips_through_json() -> None:
    manifest = Manifest(
        step=7,
        world_size=3,
        kind="sharded",
        created=123.25,
        files={"a": FileEntry(size=5, crc32=0xDEADBEEF)},
        save_seconds=0.5,
        torch_version="2.x",
    )
    text = manifest.to_json()
    body = json.loads(text)
    assert body["files"] == {"a": {"size": 5, "crc32": "deadbeef"}}
    assert body["format"] == "tidal-checkpoint" and body["version"] == 1
    assert Manifest.from_json(text, path=Path("p")) == manifest


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{", "not valid JSON"),
        ('{"format": "other"}', "format"),
        ('{"format": "tidal-checkpoint", "version": 99}', "version"),
        ('{"format": "tidal-checkpoint", "version": 1, "step": 1}', "missing or malformed"),
    ],
)
def test_a_bad_manifest_is_rejected_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=reason) as info:
        Manifest.from_json(text, path=Path("/ck/step-1"))
    assert info.value.file == MANIFEST_NAME


def test_a_manifest_cannot_point_outside_its_directory() -> None:
    body = json.loads(
        Manifest(step=1, world_size=1, kind="replicated", created=0.0, files={}).to_json()
    )
    body["files"] = {"../escape": {"size": 1, "crc32": "00000000"}}
    with pytest.raises(CheckpointCorruptError, match="invalid file name"):
        Manifest.from_json(json.dumps(body), path=Path("p"))


def test_commit_publishes_a_complete_directory_and_leaves_no_temporary(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 5)
    assert path == tmp_path / "step-0000000005"
    assert sorted(os.listdir(tmp_path)) == ["step-0000000005"]
    assert sorted(os.listdir(path)) == [MANIFEST_NAME, "state.pt"]
    manifest = store.verify(path)
    assert manifest.files["state.pt"] == FileEntry(size=1000, crc32=zlib.crc32(b"x" * 1000))


def test_commit_replaces_an_existing_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 5, b"old")
    path = write_checkpoint(store, 5, b"new!")
    assert (path / "state.pt").read_bytes() == b"new!"
    assert sorted(os.listdir(tmp_path)) == ["step-0000000005"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: os.truncate(p / "state.pt", 500), "500 bytes but the manifest says 1000"),
        (lambda p: (p / "state.pt").write_bytes(b"\0" * 1000), "CRC-32"),
        (lambda p: (p / "state.pt").unlink(), "missing"),
    ],
    ids=["truncated", "zeroed", "deleted"],
)
def test_verify_names_the_damaged_file_and_why(tmp_path: Path, damage: object, reason: str) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 3)
    damage(path)  # type: ignore[operator]
    with pytest.raises(CheckpointCorruptError, match=reason) as info:
        store.verify(path)
    assert info.value.file == "state.pt"
    assert info.value.path == path
    assert "state.pt" in str(info.value)


def test_a_missing_manifest_means_an_unusable_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 3)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json is unusable: it is missing"):
        store.verify(path)


def test_a_manifest_for_another_step_is_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 3)
    os.rename(path, tmp_path / "step-0000000004")
    with pytest.raises(CheckpointCorruptError, match="records step 3"):
        store.verify(tmp_path / "step-0000000004")


def test_read_verified_checks_the_bytes_it_returns(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 3)
    manifest = store.read_manifest(path)
    assert store.read_verified(path, manifest, "state.pt") == b"x" * 1000
    with open(path / "state.pt", "r+b") as f:
        f.seek(10)
        f.write(b"y")
    with pytest.raises(CheckpointCorruptError, match="CRC-32"):
        store.read_verified(path, manifest, "state.pt")


def test_prune_keeps_the_newest_k_by_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (4, 12, 8, 16):
        write_checkpoint(store, step)
    assert store.prune(2) == [8, 4]
    assert store.steps() == [16, 12]
    assert sorted(os.listdir(tmp_path)) == ["step-0000000012", "step-0000000016"]


def test_steps_ignore_temporary_trash_and_foreign_entries(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    store.new_temp_dir(2)
    (tmp_path / ".trash-step-0000000000-ab").mkdir()
    (tmp_path / "step-0000000009").write_text("a file, not a checkpoint")
    (tmp_path / "notes").mkdir()
    assert store.steps() == [1]
    removed = store.remove_stale()
    assert len(removed) == 2 and all(n.startswith((".tmp-", ".trash-")) for n in removed)
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-0000000001", "step-0000000009"]


def test_quarantine_moves_a_checkpoint_out_of_the_final_names(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    moved = store.quarantine(1)
    assert moved is not None and moved.name.startswith(".invalid-step-0000000001-")
    assert store.steps() == []
