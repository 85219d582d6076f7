"""rendezvous.child: the one way tidal starts and stops a supervised child, with real processes."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from rendezvous.child import Child
from tests.support.wait import wait_for

# A child that starts a grandchild ignoring SIGTERM, prints both PIDs, then waits.
STUBBORN = """
import os, signal, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(os.getpid(), grandchild.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): it is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_stop_ends_the_whole_group_even_a_grandchild_that_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Child.spawn("stubborn", [sys.executable, "-c", STUBBORN], log)
    try:
        line = wait_for(lambda: log.read_text().strip() or None, timeout=30,
                        what="the child's PIDs in its log")
        pid, grandchild = (int(p) for p in line.split())
        assert pid == child.pid and child.running()
        code = child.stop(timeout_s=0.5)
        assert code == -signal.SIGTERM
        wait_for(lambda: not _alive(grandchild), timeout=10, what="the grandchild gone")
    finally:
        child.kill()
    assert child.stop() == -signal.SIGTERM  # idempotent


def test_log_tail_reads_only_what_this_run_wrote(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("an earlier run\n")
    child = Child.spawn("echo", [sys.executable, "-c", "print('one'); print('two')"], log)
    assert child.wait(30) == 0
    assert child.log_tail() == "one\ntwo"
    assert child.log_tail(lines=1) == "two"
