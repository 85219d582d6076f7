"""The scheduler's pass acting on stragglers (service.scheduler.stragglers.act_on_stragglers):
evicted as by a drain and marked slow, or reported once; a slow node takes no new job
until its cool-down ends or an undrain clears it."""

from __future__ import annotations

import random
from datetime import timedelta

from rendezvous.records import JobNodeState
from service.api.models import EventReason, JobPhase, JobRecord, StragglerPolicy
from service.scheduler import Policy
from tests.unit.service.sim import Sim, make_job, make_node


def job(job_id: str, *, min_nodes: int, max_nodes: int, mode: str = "evict",
        created: int = 0) -> JobRecord:
    record = make_job(job_id, min_nodes=min_nodes, max_nodes=max_nodes, created=created)
    record.spec.straggler_policy = StragglerPolicy.model_validate({"mode": mode})
    return record


def report_paces(sim: Sim, job_id: str, paces: dict[str, float], steps: int = 20,
                 noise: random.Random | None = None) -> None:
    """Each node of the job reports running, with ``paces[node]`` seconds a step."""
    for node_id in sorted(sim.placed(job_id)):
        base = paces.get(node_id, 1.0)
        sim.report(job_id, node_id, JobNodeState.RUNNING, last_step=steps, paces=[
            (s, base * (noise.uniform(0.7, 1.3) if noise else 1.0)) for s in range(steps)])


def cluster(policy: Policy | None = None) -> Sim:
    sim = Sim(policy=policy or Policy(straggler_cooldown_s=600))
    sim.join(*(make_node(n) for n in "abcd"))
    return sim


def test_a_straggler_is_evicted_marked_slow_and_the_spare_takes_its_slot() -> None:
    sim = cluster()
    sim.submit(job("j", min_nodes=2, max_nodes=3))
    sim.settle()
    assert sim.placed("j") == {"a", "b", "c"}
    report_paces(sim, "j", {"c": 2.0})
    now = sim.clock
    changes = sim.step()
    (change,) = changes
    assert change.delete == ["c"] and set(change.put) == {"d"}  # the spare, in the same pass
    evicted = [e for e in sim.events["j"] if e.reason == EventReason.STRAGGLER_EVICTED]
    assert len(evicted) == 1 and evicted[0].nodes == ["c"]
    assert "2.00x the median" in evicted[0].message
    mark = sim.view.slow["c"]
    assert (mark.job_id, mark.ratio, mark.since) == ("j", 2.0, now)
    assert mark.until == now + timedelta(seconds=600)
    assert sim.job("j").restarts[EventReason.STRAGGLER_EVICTED.value] == 1
    sim.settle()
    assert sim.placed("j") == {"a", "b", "d"} and sim.phase("j") == JobPhase.RUNNING


def test_a_straggler_of_a_job_at_its_minimum_is_reported_once_and_kept() -> None:
    sim = cluster()
    sim.submit(job("j", min_nodes=2, max_nodes=2))
    sim.settle()
    slow = sorted(sim.placed("j"))[1]
    for _ in range(5):
        report_paces(sim, "j", {slow: 2.0})
        sim.step()
    reported = [e for e in sim.events["j"] if e.reason == EventReason.STRAGGLER_REPORTED]
    assert len(reported) == 1 and reported[0].nodes == [slow]
    assert "minimum of 2 nodes" in reported[0].message
    assert slow in sim.placed("j") and sim.view.slow == {}


def test_the_report_policy_never_evicts_and_says_it_once() -> None:
    sim = cluster()
    sim.submit(job("j", min_nodes=1, max_nodes=3, mode="report"))
    sim.settle()
    for _ in range(3):
        report_paces(sim, "j", {"a": 3.0})
        sim.step()
    assert sim.reasons("j").count(EventReason.STRAGGLER_REPORTED) == 1
    assert sim.placed("j") == {"a", "b", "c"} and sim.view.slow == {}


def test_the_off_policy_does_nothing() -> None:
    sim = cluster()
    sim.submit(job("j", min_nodes=1, max_nodes=3, mode="off"))
    sim.settle()
    report_paces(sim, "j", {"a": 3.0})
    sim.step()
    assert not {EventReason.STRAGGLER_EVICTED, EventReason.STRAGGLER_REPORTED} & set(
        sim.reasons("j"))
    assert sim.placed("j") == {"a", "b", "c"}


def test_a_slow_node_keeps_its_other_jobs_but_takes_no_new_one_until_the_cool_down_ends() -> None:
    sim = Sim(policy=Policy(straggler_cooldown_s=60))
    sim.join(make_node("a"), make_node("b"), make_node("c", slots=2))  # c also runs "other"
    sim.submit(job("j", min_nodes=2, max_nodes=3))
    sim.settle()
    sim.submit(job("other", min_nodes=1, max_nodes=1, mode="off", created=1))
    sim.settle()
    assert "c" in sim.placed("j") and sim.placed("other") == {"c"}
    report_paces(sim, "j", {"c": 2.0})
    sim.step()
    sim.settle()
    assert "c" not in sim.placed("j") and sim.placed("other") == {"c"}
    sim.submit(job("new", min_nodes=1, max_nodes=1, created=2))  # only c has a free slot
    sim.settle()
    assert sim.placed("new") == set() and sim.phase("new") == JobPhase.PENDING
    sim.clock += timedelta(seconds=60)
    sim.settle()
    assert sim.placed("new") == {"c"}


def test_an_undrain_clears_the_slow_mark() -> None:
    sim = cluster()
    sim.submit(job("j", min_nodes=2, max_nodes=3))
    sim.settle()
    report_paces(sim, "j", {"c": 2.0})
    sim.step()
    sim.settle()
    sim.submit(job("new", min_nodes=1, max_nodes=1, created=2))
    sim.settle()
    assert sim.placed("new") == set()
    sim.undrain("c")
    sim.settle()
    assert sim.placed("new") == {"c"} and sim.view.slow == {}


def test_a_noisy_but_not_slower_node_is_never_evicted_over_many_passes() -> None:
    rng = random.Random(27)
    sim = cluster()
    sim.submit(job("j", min_nodes=1, max_nodes=4))
    sim.settle()
    for _ in range(200):  # every node jitters by 30%; d spikes to 5x one step in 20
        report_paces(sim, "j", {}, steps=20, noise=rng)
        sim.report("j", "d", JobNodeState.RUNNING, last_step=20, paces=[
            (s, 5.0 if rng.random() < 0.05 else rng.uniform(0.7, 1.3)) for s in range(20)])
        sim.step()
    assert EventReason.STRAGGLER_EVICTED not in sim.reasons("j")
    assert EventReason.STRAGGLER_REPORTED not in sim.reasons("j")
    assert sim.placed("j") == {"a", "b", "c", "d"}
