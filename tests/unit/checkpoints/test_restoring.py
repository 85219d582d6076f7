"""Reading a replicated checkpoint: its CRC-32 checked in place, then torch.load, mapped or not."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

import checkpoints as ck
from checkpoints.errors import CheckpointCorruptError
from checkpoints.files import crc32_combine, file_crc32
from checkpoints.restoring import copy_off_mapping, maps_to_device, read_replicated
from checkpoints.state import STATE_FILE
from checkpoints.storage import CheckpointStore


def save_job(root: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 600), torch.nn.Linear(600, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    with ck.Checkpointer(root, model=model, optimizer=optimizer, async_save=False,
                         jit_save=False, handle_sigterm=False,
                         extra_state=lambda: {"table": torch.arange(10)}) as ckpt:
        ckpt.save(3)
    return model, optimizer


def test_crc32_combine_joins_the_crcs_of_two_parts_as_zlib_would() -> None:
    rng = random.Random(0)
    for _ in range(100):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_file_crc32_is_zlibs_whatever_the_number_of_readers(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("checkpoints.files._MIN_REGION", 1000)
    data = random.Random(threads).randbytes(10_007)
    (tmp_path / "f").write_bytes(data)
    assert file_crc32(tmp_path / "f", threads=threads) == (len(data), zlib.crc32(data))
    (tmp_path / "empty").write_bytes(b"")
    assert file_crc32(tmp_path / "empty", threads=threads) == (0, 0)


@pytest.mark.parametrize("mmap", [False, True])
def test_read_replicated_gives_back_what_was_saved(tmp_path: Path, mmap: bool) -> None:
    model, optimizer = save_job(tmp_path)
    store = CheckpointStore(tmp_path)
    manifest, state = read_replicated(store, store.path_of(3), mmap=mmap)
    assert manifest.step == state["step"] == 3
    torch.testing.assert_close(state["model"], model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(state["optimizer"]["state"], optimizer.state_dict()["state"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_flipped_byte_inside_a_tensor_fails_the_crc_before_anything_is_loaded(
    tmp_path: Path, mmap: bool
) -> None:
    save_job(tmp_path)
    store = CheckpointStore(tmp_path)
    path = store.path_of(3)
    file = path / STATE_FILE
    with open(file, "r+b") as f:  # tensor data, which a mapped torch.load never reads
        f.seek(file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="CRC-32") as info:
        read_replicated(store, path, mmap=mmap)
    assert info.value.file == STATE_FILE


def test_a_truncated_file_is_refused_by_its_size_before_it_is_read(tmp_path: Path) -> None:
    save_job(tmp_path)
    store = CheckpointStore(tmp_path)
    file = store.path_of(3) / STATE_FILE
    os.truncate(file, file.stat().st_size // 2)
    with pytest.raises(CheckpointCorruptError, match="bytes but the manifest says"):
        read_replicated(store, store.path_of(3), mmap=True)


def test_a_mapped_load_keeps_only_the_large_model_and_optimizer_tensors_on_the_file(
    tmp_path: Path,
) -> None:
    save_job(tmp_path)
    store = CheckpointStore(tmp_path)
    _, state = read_replicated(store, store.path_of(3), mmap=True)
    again = copy_off_mapping(state)
    # 512 x 600 float32 (1.2 MB) stays a view of the file: load_state_dict copies it
    assert again["model"]["0.weight"] is state["model"]["0.weight"]
    assert again["optimizer"]["state"][0]["exp_avg"] is state["optimizer"]["state"][0]["exp_avg"]
    # the optimizer keeps its step tensors as they are, the user keeps extras: copied
    assert again["optimizer"]["state"][0]["step"] is not state["optimizer"]["state"][0]["step"]
    assert again["extra"]["table"] is not state["extra"]["table"]
    assert again["model"]["0.bias"] is not state["model"]["0.bias"]
    for key in ("model", "optimizer", "extra"):
        torch.testing.assert_close(again[key], state[key], rtol=0, atol=0)


def test_only_a_model_wholly_on_an_accelerator_is_loaded_mapped() -> None:
    assert not maps_to_device(torch.nn.Linear(2, 2))
    assert not maps_to_device(None)
    assert not maps_to_device(torch.nn.ReLU())
    assert not maps_to_device(torch.nn.Linear(2, 2, device="meta"))
