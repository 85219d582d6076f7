"""Which way each node's membership change went (agent.runner.live_decide), as the job's
events tell it.

A runner counts the path its membership changes took in its status
(``resize_paths``: live or restart, per assignment generation); the scheduler
gives each rise one event per path and pass (:func:`service.scheduler.resize_rises`),
derived from the record in etcd, so a new leader repeats none.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from rendezvous.records import JobNodeState, JobNodeStatus
from service.api.models import EventReason, JobPhase, SeenResizes
from service.scheduler import plan
from service.scheduler.reports import resize_rises
from tests.unit.service.sim import Sim, make_job, make_node

T = datetime(2026, 1, 1, tzinfo=timezone.utc)


def status(node: str, generation: int, last: str | None = None, **paths: int) -> JobNodeStatus:
    return JobNodeStatus(job_id="j", node_id=node, generation=generation,
                         state=JobNodeState.RUNNING, resize_paths=paths, last_resize=last,
                         updated_at=T)


def test_a_rise_of_a_path_is_reported_once_and_nodes_not_in_force_are_forgotten() -> None:
    seen = {"a": SeenResizes(generation=3, paths={"live": 1}),
            "gone": SeenResizes(generation=2, paths={"live": 4})}
    statuses = {"a": status("a", 3, "restart (timeout)", live=1, restart=1),
                "b": status("b", 5, "live", live=2), "c": status("c", 1, live=1)}
    folded, rises = resize_rises(seen, {"a": 3, "b": 5, "c": 2}, statuses)
    assert {path: [st.node_id for st in reports] for path, reports in rises.items()} == {
        "restart": ["a"], "live": ["b"]}
    assert folded == {"a": SeenResizes(generation=3, paths={"live": 1, "restart": 1}),
                      "b": SeenResizes(generation=5, paths={"live": 2})}
    assert resize_rises(folded, {"a": 3, "b": 5, "c": 2}, statuses) == (folded, {})


def set_status(sim: Sim, st: JobNodeStatus) -> None:
    statuses = {job: dict(per_node) for job, per_node in sim.view.statuses.items()}
    statuses.setdefault("j", {})[st.node_id] = st
    sim.view = replace(sim.view, statuses=statuses)


def test_the_job_events_say_which_nodes_resized_live_and_which_by_a_restart() -> None:
    sim = Sim()
    sim.join(*(make_node(n) for n in ("a", "b", "c")))
    sim.submit(make_job("j", min_nodes=1, max_nodes=3))
    sim.settle()
    assert sim.phase("j") == JobPhase.RUNNING
    generation = {n: sim.assignment("j", n).generation for n in ("a", "b", "c")}
    set_status(sim, status("a", generation["a"], "live", live=1))
    set_status(sim, status("b", generation["b"], "live", live=1))
    set_status(sim, status("c", generation["c"], "restart (timeout)", restart=1))
    sim.step()
    said = [(e.reason, e.nodes, e.message) for e in sim.events["j"]
            if e.reason in (EventReason.RESIZED_LIVE, EventReason.RESIZED_BY_RESTART)]
    assert said == [
        (EventReason.RESIZED_LIVE, ["a", "b"], "resized live on a, b"),
        (EventReason.RESIZED_BY_RESTART, ["c"], "resized by a restart on c: timeout"),
    ]
    # The same view planned again (a new leader after the write): nothing repeated.
    changes = plan(sim.view, sim.clock)
    assert not any(e.reason in (EventReason.RESIZED_LIVE, EventReason.RESIZED_BY_RESTART)
                   for c in changes for e in c.events)
