"""Rank logs stay under their cap while a real worker keeps writing to them."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from agent.workers.logcap import LogCap
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

CHATTY = "import itertools\nfor i in itertools.count():\n    print(f'line {i:08d}', flush=True)\n"


def test_a_chatty_worker_is_capped_by_copy_and_truncate_without_holes(
    tmp_path: Path, procs: ProcessGroupRegistry
):
    log_dir = tmp_path / "logs" / "attempt_0" / "0"
    log_dir.mkdir(parents=True)
    out = log_dir / "stdout.log"
    # torch opens the file with "w" (no O_APPEND); the shim re-opens it for appending.
    worker = procs.spawn(
        [sys.executable, "-m", "agent.workers.shim", str(os.getpid()), "--",
         sys.executable, "-c", CHATTY],
        log_path=out,
        append=False,
    )
    cap = LogCap(tmp_path / "logs", max_bytes=64 * 1024, interval_s=0.05).start()
    try:
        wait_for(lambda: cap.rotations >= 3, timeout=30, what="three rotations")
        assert worker.poll() is None
    finally:
        procs.kill_group(worker)
        cap.close()
    rotated = log_dir / "stdout.log.1"
    assert rotated.exists()
    # Private: the log directory 0700, the logs (made 0644 by the umask) 0600.
    assert _mode(tmp_path / "logs") == 0o700
    assert _mode(out) == 0o600 and _mode(rotated) == 0o600
    for path in (out, rotated):
        data = path.read_bytes()
        assert b"\0" not in data, f"{path} has a hole: the writer did not append"
    # The newest lines are in the live file, continuing the rotated one.
    # (A copy can end, and a truncation leave, half a line: count whole lines.)
    last_rotated = max(int(n) for n in re.findall(r"line (\d{8})\n", rotated.read_text()))
    live = [int(n) for n in re.findall(r"line (\d{8})\n", out.read_text())]
    assert all(n > last_rotated for n in live)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_the_shim_makes_its_log_private_before_the_worker_writes(
    tmp_path: Path, procs: ProcessGroupRegistry
):
    out = tmp_path / "stdout.log"
    out.touch(mode=0o644)
    os.chmod(out, 0o644)
    # The worker reports the mode its own output file has when it starts.
    worker = procs.spawn(
        [sys.executable, "-m", "agent.workers.shim", str(os.getpid()), "--", sys.executable,
         "-c", "import os, stat; print(oct(stat.S_IMODE(os.fstat(1).st_mode)), flush=True)"],
        log_path=out,
        append=False,
    )
    assert worker.wait(30) == 0
    assert out.read_text().strip() == "0o600"
