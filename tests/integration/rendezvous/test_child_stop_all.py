"""rendezvous.child.stop_all: several children stopped at once, as Child.stop stops one."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from rendezvous.child import Child, stop_all
from tests.support.wait import wait_for

# Prints its pid once its SIGTERM handler is in place; exits 3 on SIGTERM.
POLITE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
print(os.getpid(), flush=True)
time.sleep(600)
"""
# Prints its pid once it ignores SIGTERM.
DEAF = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def _spawn(tmp_path: Path, name: str, code: str) -> Child:
    log = tmp_path / f"{name}.log"
    child = Child.spawn(name, [sys.executable, "-c", code], log)
    wait_for(lambda: log.read_text().strip() or None, timeout=30, what=f"{name}'s pid")
    return child


def test_stop_all_terms_each_child_and_kills_the_one_that_ignores_it(tmp_path: Path) -> None:
    done = Child.spawn("done", [sys.executable, "-c", "pass"], tmp_path / "done.log")
    assert done.wait(30) == 0
    children = [_spawn(tmp_path, "polite", POLITE), _spawn(tmp_path, "deaf", DEAF), done]
    try:
        codes = stop_all(children, timeout_s=0.5)
    finally:
        for child in children:
            child.kill()
    assert codes == [3, -signal.SIGKILL, 0]
    assert not any(child.running() for child in children)
