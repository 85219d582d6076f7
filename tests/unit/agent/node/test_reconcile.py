"""The daemon carries its runner plan out (agent.node.daemon.Agent.reconcile; the plan itself:
test_plan.py): a stop is one SIGTERM, new bounds go to the runner in place."""

from __future__ import annotations

import signal
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.node.daemon import Agent, _Runner
from agent.node.metrics import AgentMetrics
from agent.node.settings import AgentSettings
from agent.node.warm_policy import WarmTimer
from rendezvous.records import Assignment


class FakeProcess:
    """A runner that never exits on its own; remembers the signals it got."""

    pid = 4242

    def __init__(self) -> None:
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def agent_running(tmp_path: Path, *assignments: Assignment) -> tuple[Agent, dict[str, FakeProcess]]:
    agent = Agent(AgentSettings(node_id="n", run_dir=tmp_path))
    agent.metrics = AgentMetrics(CollectorRegistry(), slots=1)
    processes = {}
    for assignment in assignments:
        processes[assignment.job_id] = process = FakeProcess()
        agent.state.runners[assignment.job_id] = _Runner(
            assignment, process, tmp_path / "runner.log")  # type: ignore[arg-type]
    return agent, processes


def job(job_id: str, generation: int = 1, *, max_nodes: int = 2) -> Assignment:
    return Assignment(job_id=job_id, generation=generation, command=["true"], min_nodes=1,
                      max_nodes=max_nodes)


def test_a_runner_whose_assignment_is_gone_gets_one_sigterm_and_no_restart_is_counted(
    tmp_path: Path,
) -> None:
    agent, processes = agent_running(tmp_path, job("j"))
    agent.reconcile({})
    agent.reconcile({})
    assert processes["j"].signals == [signal.SIGTERM]
    assert agent.state.runners["j"].stop_deadline is not None
    assert agent.metrics is not None and agent.metrics.restarts() == {}


def test_a_new_generation_stops_the_runner_and_wants_a_warm_successor_at_once(
    tmp_path: Path,
) -> None:
    agent, processes = agent_running(tmp_path, job("j"))
    agent.warm.timer = WarmTimer(due=1e12)
    agent.reconcile({"j": job("j", 2)})
    assert processes["j"].signals == [signal.SIGTERM]
    assert agent.warm.timer.due == 0.0
    assert agent.state.runners["j"].assignment == job("j")  # it runs its own until it is gone


def test_new_bounds_go_to_the_runner_in_place_without_a_signal(tmp_path: Path) -> None:
    agent, processes = agent_running(tmp_path, job("j"))
    agent.reconcile({"j": job("j", max_nodes=5)})
    assert processes["j"].signals == []
    assert agent.state.runners["j"].assignment == job("j", max_nodes=5)
    assert agent.state.runners["j"].stop_deadline is None


def test_a_new_generation_of_a_running_job_is_counted_once_as_scaled(tmp_path: Path) -> None:
    agent, _ = agent_running(tmp_path, job("j"), job("k"))
    rebound = job("j", 2, max_nodes=3)
    agent.reconcile({"j": rebound})  # j: new bounds, new generation; k: unassigned
    agent.reconcile({"j": rebound})  # the old runner is still stopping: counted once
    assert agent.metrics is not None and agent.metrics.restarts() == {"j": {"scaled": 1}}
