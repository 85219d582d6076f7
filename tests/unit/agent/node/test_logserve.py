"""The agent's log route: which files, which lines, the query's checks (the server's refusal
of a request without its token, on loopback: tests/integration/agent/node/test_logserve.py)."""

from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path

import pytest

from agent.node.logserve import (
    MAX_LINE_BYTES,
    BadRequestError,
    find_log_files,
    parse_log_query,
    stream_job_logs,
    tail_offset,
)
from rendezvous.keys import InvalidIdentifierError

JOB = "train-0123abcd"


def _log(run_dir: Path, generation: int, attempt: int, rank: int, text: str,
         stream: str = "stdout", run: str = "run") -> Path:
    path = (run_dir / "jobs" / JOB / f"gen-{generation}" / "logs" / run / f"attempt_{attempt}"
            / str(rank) / f"{stream}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)
    return path


def _lines(records: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [(r["generation"], r["attempt"], r["rank"], r["stream"], r["line"])
            for r in records if "line" in r]


def test_files_are_found_oldest_attempt_first_and_filtered(tmp_path: Path) -> None:
    _log(tmp_path, 2, 0, 0, "x\n")
    _log(tmp_path, 1, 1, 1, "x\n", stream="stderr")
    _log(tmp_path, 1, 1, 0, "x\n")
    _log(tmp_path, 1, 0, 0, "x\n")
    (tmp_path / "jobs" / JOB / "gen-x").mkdir()
    found = [(f.generation, f.attempt, f.rank, f.stream) for f in find_log_files(tmp_path, JOB)]
    assert found == [(1, 0, 0, "stdout"), (1, 1, 0, "stdout"), (1, 1, 1, "stderr"),
                     (2, 0, 0, "stdout")]
    assert [f.rank for f in find_log_files(tmp_path, JOB, rank=1)] == [1]
    assert [f.generation for f in find_log_files(tmp_path, JOB, after_generation=1)] == [2]
    assert find_log_files(tmp_path, "other-job") == []
    with pytest.raises(InvalidIdentifierError):
        find_log_files(tmp_path, "../etc")


def test_a_symlinked_log_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("do not serve\n")
    path = _log(tmp_path, 1, 0, 0, "")
    path.unlink()
    path.symlink_to(secret)
    assert find_log_files(tmp_path, JOB) == []


def test_tail_offset_finds_the_last_lines(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a\nb\nc\n")
    assert path.read_bytes()[tail_offset(path, 2):] == b"b\nc\n"
    assert tail_offset(path, 10) == 0
    assert tail_offset(path, 0) == 6
    path.write_bytes(b"a\nb\nc")  # no final newline: c is a line
    assert path.read_bytes()[tail_offset(path, 1, block=2):] == b"c"


def test_without_follow_every_line_then_end_and_tail_keeps_the_newest_attempt(
    tmp_path: Path,
) -> None:
    _log(tmp_path, 1, 0, 0, "old 1\nold 2\n")
    _log(tmp_path, 1, 1, 0, "new 1\nnew 2\nnew 3\npartial")
    records = list(stream_job_logs(tmp_path, JOB))
    assert records[-1] == {"end": True}
    assert [r[4] for r in _lines(records)] == ["old 1", "old 2", "new 1", "new 2", "new 3",
                                               "partial"]
    tailed = _lines(list(stream_job_logs(tmp_path, JOB, tail=2)))
    assert tailed == [(1, 1, 0, "stdout", "new 3"), (1, 1, 0, "stdout", "partial")]


def test_a_long_line_comes_in_pieces(tmp_path: Path) -> None:
    _log(tmp_path, 1, 0, 0, "y" * (MAX_LINE_BYTES * 2 + 5) + "\n")
    pieces = [str(r[4]) for r in _lines(list(stream_job_logs(tmp_path, JOB)))]
    assert [len(p) for p in pieces] == [MAX_LINE_BYTES, MAX_LINE_BYTES, 5]


def test_a_big_log_streams_in_little_memory(tmp_path: Path) -> None:
    path = _log(tmp_path, 1, 0, 0, "")
    line = "z" * 999 + "\n"
    with open(path, "w") as f:
        for _ in range(16):
            f.write(line * 1024)  # 16 MB
    tracemalloc.start()
    try:
        count = sum(1 for r in stream_job_logs(tmp_path, JOB) if "line" in r)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 16 * 1024
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes for a 16 MB log"


def test_follow_sends_new_lines_and_new_attempts_until_the_job_is_idle(tmp_path: Path) -> None:
    _log(tmp_path, 1, 0, 0, "one\n")
    active = threading.Event()
    active.set()
    idle = threading.Event()
    records = stream_job_logs(tmp_path, JOB, follow=True, active=active.is_set,
                              poll_s=0.01, heartbeat_s=0.05, on_idle=idle.set)
    assert next(records)["line"] == "one"
    assert next(records) == {"heartbeat": True}
    _log(tmp_path, 1, 0, 0, "two, written in ")
    _log(tmp_path, 1, 0, 0, "two writes\n")
    _log(tmp_path, 1, 1, 0, "a new attempt\n")
    got = []
    for record in records:
        if "line" in record:
            got.append((record["attempt"], record["line"]))
        if len(got) == 2:
            break
    assert got == [(0, "two, written in two writes"), (1, "a new attempt")]
    assert idle.is_set()
    _log(tmp_path, 1, 1, 0, "last words, no newline")
    active.clear()
    rest = list(records)
    assert [r.get("line") for r in rest if "line" in r] == ["last words, no newline"]
    assert rest[-1] == {"end": True}


def test_a_rotated_log_is_read_again_from_its_start(tmp_path: Path) -> None:
    path = _log(tmp_path, 1, 0, 0, "before rotation\n")
    active = threading.Event()
    active.set()
    records = stream_job_logs(tmp_path, JOB, follow=True, active=active.is_set, poll_s=0.01,
                              heartbeat_s=0.01)
    assert next(records)["line"] == "before rotation"
    path.write_text("after\n")  # copied away and truncated, then written again
    line = next(r for r in records if "line" in r)
    assert line["line"] == "after"


def test_the_query_is_checked() -> None:
    query = parse_log_query(f"/v1/jobs/{JOB}/logs?rank=1&tail=5&follow=true&after_generation=3")
    assert query is not None
    assert (query.job_id, query.rank, query.tail, query.follow, query.after_generation) == (
        JOB, 1, 5, True, 3)
    assert parse_log_query("/metrics") is None
    assert parse_log_query(f"/v1/jobs/{JOB}/x/logs") is None
    for bad in ("rank=-1", "tail=x", "follow=maybe", "rank=99999999"):
        with pytest.raises(BadRequestError):
            parse_log_query(f"/v1/jobs/{JOB}/logs?{bad}")
    for job in ("..", "a%2Fb", "-x"):
        with pytest.raises(InvalidIdentifierError):
            parse_log_query(f"/v1/jobs/{job}/logs")
