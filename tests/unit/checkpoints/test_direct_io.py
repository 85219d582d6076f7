"""Direct-I/O checkpoint files: the same bytes and CRC-32 as the buffered writer, and fallbacks.

Every test writes real files: tmp_path (ext4 here) takes O_DIRECT. The fallback on a
filesystem that refuses it, which needs a mount of its own as root, is
tests/integration/checkpoints/test_direct_io.py.
"""

from __future__ import annotations

import array
import fcntl
import logging
import mmap
import os
import random
import threading
import zlib
from pathlib import Path

import pytest
import torch

import checkpoints as ck
from checkpoints.files import (
    STAGING_BYTES,
    CheckpointFileWriter,
    ChecksumWriter,
    DirectWriter,
    file_crc32,
    open_for_checkpoint,
    use_direct_io,
)

CHUNK = STAGING_BYTES


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def write(path: Path, pieces: list[bytes | memoryview], *, direct: bool) -> CheckpointFileWriter:
    with use_direct_io(direct), open_for_checkpoint(path) as writer:
        for piece in pieces:
            assert writer.write(piece) == memoryview(piece).nbytes
        writer.flush()  # as torch.save does, at any point: it must not break alignment
    return writer


def assert_same_as_buffered(tmp_path: Path, pieces: list[bytes | memoryview]) -> DirectWriter:
    direct = write(tmp_path / "direct.pt", pieces, direct=True)
    buffered = write(tmp_path / "buffered.pt", pieces, direct=False)
    assert isinstance(direct, DirectWriter) and isinstance(buffered, ChecksumWriter)
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    assert (tmp_path / "direct.pt").read_bytes() == expected
    assert (tmp_path / "buffered.pt").read_bytes() == expected
    size_and_crc = (len(expected), zlib.crc32(expected))
    assert (direct.size, direct.crc32) == (buffered.size, buffered.crc32) == size_and_crc
    assert file_crc32(tmp_path / "direct.pt") == (direct.size, direct.crc32)
    return direct


@pytest.mark.parametrize(
    "size",
    [0, 1, 4095, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 4096 + 123],
    ids=["0", "1", "page-1", "page", "chunk-1", "chunk", "chunk+1", "3-chunks+page+tail"],
)
def test_one_write_gives_the_bytes_and_crc_of_the_buffered_writer(
    tmp_path: Path, size: int
) -> None:
    direct = assert_same_as_buffered(tmp_path, [payload(size)])
    # A whole number of pages never leaves direct I/O; only a partial last page does.
    assert direct.direct == (size % 4096 == 0)


def test_many_small_writes_across_chunk_boundaries_give_the_same_file(tmp_path: Path) -> None:
    rng = random.Random(7)
    pieces: list[bytes | memoryview] = [payload(rng.randint(1, 6000), seed=i) for i in range(8000)]
    pieces.insert(100, memoryview(array.array("d", [1.5] * 1000)))  # a view that is not bytes
    assert sum(memoryview(p).nbytes for p in pieces) > 2 * CHUNK
    assert_same_as_buffered(tmp_path, pieces)


def test_one_huge_read_only_memoryview_gives_the_same_file(tmp_path: Path) -> None:
    huge = memoryview(payload(5 * CHUNK + 777))  # read-only, like torch.save's views
    assert_same_as_buffered(tmp_path, [payload(10, seed=1), huge, payload(3, seed=2)])


def test_a_torch_save_through_it_loads_with_weights_only_and_equals_the_original(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(1000, 3000), "b": torch.randn(3000, dtype=torch.float64)},
        "half": torch.randn(777, dtype=torch.bfloat16),
        "ids": torch.arange(12345, dtype=torch.int64),
        "step": 42,
        "note": "hi",
    }
    path = tmp_path / "state.pt"
    with open_for_checkpoint(path) as writer:
        torch.save(state, writer)  # type: ignore[arg-type]
    assert isinstance(writer, DirectWriter) and writer.size > CHUNK
    assert file_crc32(path) == (writer.size, writer.crc32)
    loaded = torch.load(path, weights_only=True)
    assert (loaded.pop("step"), loaded.pop("note")) == (state.pop("step"), state.pop("note"))
    torch.testing.assert_close(loaded, state, rtol=0, atol=0)


def test_the_switch_applies_to_the_thread_that_sets_it_only(tmp_path: Path) -> None:
    seen: dict[str, type] = {}

    def other_thread() -> None:
        with open_for_checkpoint(tmp_path / "other") as writer:
            seen["other"] = type(writer)

    with use_direct_io(False):
        with open_for_checkpoint(tmp_path / "here") as writer:
            seen["here"] = type(writer)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == {"here": ChecksumWriter, "other": DirectWriter}


def test_a_refused_direct_write_goes_on_through_the_page_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A staging buffer one byte off a page boundary: the kernel refuses the direct
    # write with EINVAL, as a filesystem with a larger block size would.
    data = payload(2 * CHUNK + 99)
    path = tmp_path / "misaligned.pt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    buffer = mmap.mmap(-1, CHUNK + 4096, mmap.MAP_PRIVATE)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        with memoryview(buffer) as whole, caplog.at_level(logging.WARNING):
            writer = DirectWriter(fd, whole[1 : 1 + CHUNK], path=path)
            writer.write(data)
            writer.finish()
    finally:
        os.close(fd)  # the mmap goes with the last view of it
    assert not writer.direct
    assert path.read_bytes() == data
    assert (writer.size, writer.crc32) == (len(data), zlib.crc32(data))
    refusals = [r for r in caplog.records if "direct write was refused" in r.getMessage()]
    assert len(refusals) == 1 and str(path) in refusals[0].getMessage()


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_checkpointer_restores_the_same_state_either_way_and_reports_writer_cpu(
    tmp_path: Path, direct_io: bool
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1500, 1500)  # 9 MB: more than one staging buffer
    with ck.Checkpointer(tmp_path, model=model, handle_sigterm=False, direct_io=direct_io) as ckpt:
        ckpt.save(3)
    record = ckpt.saves[-1]
    assert record.path is not None and record.error is None
    assert record.writer_user_seconds is not None and record.writer_user_seconds > 0
    assert record.writer_system_seconds is not None and record.writer_system_seconds >= 0
    restored = torch.nn.Linear(1500, 1500)
    with ck.Checkpointer(tmp_path, model=restored, handle_sigterm=False) as ckpt:
        assert ckpt.restore().step == 3
    torch.testing.assert_close(restored.state_dict(), model.state_dict(), rtol=0, atol=0)
