"""service.up.supervisor: the supervisor's pass over tidal up's children, with real processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from service.up.children import RestartPolicy, SupervisedChild
from service.up.supervisor import Supervisor
from tests.support.wait import wait_for

SLEEPS = [sys.executable, "-c", "import time; time.sleep(600)"]
EXITS_3 = [sys.executable, "-c", "raise SystemExit(3)"]


def _spawn(tmp_path: Path, name: str, argv: list[str]) -> SupervisedChild:
    return SupervisedChild.spawn(name, argv, log_path=tmp_path / f"{name}.log",
                                 ready_file=tmp_path / f"{name}.ready", run_dir=tmp_path)


def test_without_supervision_an_exited_agent_is_dropped_and_reported_as_not_essential(
    tmp_path: Path,
) -> None:
    changes: list[list[SupervisedChild]] = []
    sup = Supervisor(policy=RestartPolicy(), respawn=lambda old: old, on_change=changes.append)
    sup.coordinator = _spawn(tmp_path, "coordinator", SLEEPS)
    sup.agents["node-1"] = agent = _spawn(tmp_path, "node-1", EXITS_3)
    try:
        wait_for(lambda: agent.proc.poll() is not None, timeout=30, what="node-1 to exit")
        sup.collect_exits(time.monotonic(), restart=False)
        (exit_,) = sup.take_exits()
        assert (exit_.name, exit_.returncode, exit_.essential) == ("node-1", 3, False)
        assert sup.agents == {} and changes == [[]]
        assert sup.coordinator_pid() == sup.coordinator.pid
        assert sup.take_exits() == []
    finally:
        for child in (sup.coordinator, agent):
            child.proc.kill()


def test_a_pass_starts_a_dead_agent_again_under_its_name_and_counts_the_restart(
    tmp_path: Path,
) -> None:
    started: list[SupervisedChild] = []

    def respawn(old: SupervisedChild) -> SupervisedChild:
        started.append(_spawn(tmp_path, old.name, SLEEPS))
        return started[-1]

    sup = Supervisor(policy=RestartPolicy(base_s=0.0), respawn=respawn,
                     on_change=lambda came_back: None)
    sup.agents["node-1"] = first = _spawn(tmp_path, "node-1", EXITS_3)
    try:
        wait_for(lambda: first.proc.poll() is not None, timeout=30, what="node-1 to exit")
        sup.supervise_once(time.monotonic())  # notes the death; the restart is due at once
        assert [e.essential for e in sup.take_exits()] == [False]
        assert sup.agents["node-1"] is started[0] and sup.restarts("node-1") == 1
        sup.supervise_once(time.monotonic())  # it runs: nothing more to do
        assert len(started) == 1 and sup.take_exits() == []
    finally:
        for child in (first, *started):
            child.proc.kill()
