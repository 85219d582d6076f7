"""Which runners the daemon stops, rebounds and starts, and which assignment a job runs
(agent.node.plan)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.node.plan import (
    RunnerPlan,
    RunnerView,
    Stop,
    StopReason,
    choose_assignment,
    plan_runners,
)
from rendezvous.records import Assignment


def job(job_id: str = "j", generation: int = 1, *, min_nodes: int = 1, max_nodes: int = 2,
        command: str = "pass") -> Assignment:
    return Assignment(job_id=job_id, generation=generation, command=["python", "-c", command],
                      min_nodes=min_nodes, max_nodes=max_nodes)


class Asked:
    """An ``admitted`` answer that remembers whether it was asked."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.answer


def choose(written: Assignment, admitted: Callable[[], bool], *,
           runner: Assignment | None = None, exited: Assignment | None = None,
           finished: int | None = None) -> Assignment | None:
    return choose_assignment(written, runner=runner, exited=exited,
                             finished_generation=finished, admitted=admitted)


# choose_assignment ---------------------------------------------------------------


def test_a_new_assignment_runs_once_admitted() -> None:
    assert choose(job(), Asked(True)) == job()
    assert choose(job(), Asked(False)) is None


def test_a_new_generation_not_admitted_leaves_the_runner_on_the_old_one() -> None:
    old, new = job(generation=1), job(generation=2, max_nodes=3)
    assert choose(new, Asked(False), runner=old) == old
    assert choose(new, Asked(True), runner=old) == new


def test_the_running_generation_is_not_asked_again_when_unchanged() -> None:
    asked = Asked(False)
    assert choose(job(), asked, runner=job()) == job()
    assert asked.asked == 0


def test_new_bounds_in_place_are_taken_over_once_confirmed() -> None:
    running, written = job(max_nodes=2), job(max_nodes=4)
    assert choose(written, Asked(True), runner=running) == written
    assert choose(written, Asked(False), runner=running) == running  # not confirmed yet


def test_nothing_but_the_bounds_is_taken_from_a_rewrite_in_place() -> None:
    running, written = job(), job(command="other", max_nodes=4)
    assert choose(written, Asked(True), runner=running) == running


def test_an_exited_runners_generation_is_kept_for_its_aftermath() -> None:
    exited = job(max_nodes=2)
    assert choose(job(max_nodes=3), Asked(True), exited=exited) == job(max_nodes=3)
    assert choose(job(max_nodes=3), Asked(False), exited=exited) == exited


def test_a_finished_generation_is_kept_without_asking() -> None:
    asked = Asked(False)
    assert choose(job(generation=4), asked, finished=4) == job(generation=4)
    assert asked.asked == 0
    assert choose(job(generation=5), Asked(False), finished=4) is None


# plan_runners --------------------------------------------------------------------


def plan(desired: dict[str, Assignment], runners: dict[str, RunnerView] | None = None, *,
         exited: tuple[str, ...] = (), finished: dict[str, int] | None = None) -> RunnerPlan:
    return plan_runners(desired=desired, runners=runners or {}, exited=exited,
                        finished=finished or {})


def running(assignment: Assignment, *, stopping: bool = False) -> RunnerView:
    return RunnerView(assignment, stopping=stopping)


def test_an_assignment_without_a_runner_starts_one() -> None:
    assert plan({"j": job()}) == RunnerPlan(start=(job(),))


def test_a_runner_whose_assignment_is_gone_is_stopped_and_not_counted() -> None:
    assert plan({}, {"j": running(job())}) == RunnerPlan(stop=(Stop("j", StopReason.UNASSIGNED),))
    assert not Stop("j", StopReason.UNASSIGNED).scaled


def test_a_new_generation_stops_the_runner_as_a_scaled_restart_and_starts_nothing_yet() -> None:
    result = plan({"j": job(generation=2)}, {"j": running(job(generation=1))})
    assert result == RunnerPlan(stop=(Stop("j", StopReason.NEW_GENERATION),))
    assert result.stop[0].scaled


def test_a_runner_already_stopping_is_stopped_once() -> None:
    assert plan({"j": job(generation=2)}, {"j": running(job(), stopping=True)}) == RunnerPlan()
    assert plan({}, {"j": running(job(), stopping=True)}) == RunnerPlan()


def test_new_bounds_at_the_same_generation_go_to_the_runner_in_place() -> None:
    assert plan({"j": job(max_nodes=5)}, {"j": running(job())}) == RunnerPlan(
        rebound=(job(max_nodes=5),))
    assert plan({"j": job()}, {"j": running(job())}) == RunnerPlan()


def test_a_job_whose_runner_exited_waits_for_its_aftermath() -> None:
    assert plan({"j": job()}, exited=("j",)) == RunnerPlan()


def test_a_generation_that_finished_here_is_not_started_again_but_the_next_is() -> None:
    assert plan({"j": job(generation=3)}, finished={"j": 3}) == RunnerPlan()
    assert plan({"j": job(generation=4)}, finished={"j": 3}) == RunnerPlan(
        start=(job(generation=4),))


# properties ----------------------------------------------------------------------

JOBS = ("a", "b", "c", "d")
#: Each job's assignments: three generations, each with three bounds (built once: speed).
POOL = {j: [job(j, g, max_nodes=m) for g in (1, 2, 3) for m in (1, 2, 3)] for j in JOBS}


@dataclass(frozen=True)
class Situation:
    desired: dict[str, Assignment]
    runners: dict[str, RunnerView]
    exited: set[str]
    finished: dict[str, int]

    def plan(self, runners: dict[str, RunnerView] | None = None) -> RunnerPlan:
        return plan_runners(desired=self.desired, exited=self.exited, finished=self.finished,
                            runners=self.runners if runners is None else runners)


@st.composite
def situations(draw: st.DrawFn) -> Situation:
    """Any desired assignments, runners, exited runners and finished generations, with a
    job never both running and exited (the daemon moves it from one to the other)."""
    desired = {j: draw(st.sampled_from(POOL[j])) for j in JOBS if draw(st.booleans())}
    runners = {j: running(draw(st.sampled_from(POOL[j])), stopping=draw(st.booleans()))
               for j in JOBS if draw(st.booleans())}
    exited = {j for j in JOBS if j not in runners and draw(st.booleans())}
    finished = {j: draw(st.integers(1, 3)) for j in JOBS if draw(st.booleans())}
    return Situation(desired, runners, exited, finished)


@settings(max_examples=300, deadline=None)
@given(situations())
def test_a_plan_never_makes_two_runners_for_a_job_nor_reruns_a_finished_generation(
    situation: Situation,
) -> None:
    desired, runners, exited, finished = (situation.desired, situation.runners,
                                          situation.exited, situation.finished)
    result = situation.plan()
    started = [a.job_id for a in result.start]
    stopped = [s.job_id for s in result.stop]
    assert len(set(started)) == len(started)
    assert not set(started) & (set(runners) | exited)  # never two runners for one job
    assert not set(started) & set(stopped)  # a stopped runner is not restarted by this plan
    assert all(finished.get(a.job_id) != a.generation for a in result.start)
    assert all(a == desired[a.job_id] for a in result.start)
    assert all(not runners[j].stopping for j in stopped)
    for assignment in result.rebound:  # bounds only, at the runner's own generation
        assert assignment.generation == runners[assignment.job_id].assignment.generation
        assert assignment.job_id not in stopped


@settings(max_examples=300, deadline=None)
@given(situations())
def test_a_plan_carried_out_leaves_nothing_more_to_do(situation: Situation) -> None:
    result = situation.plan()
    after = dict(situation.runners)
    for stop in result.stop:
        after[stop.job_id] = RunnerView(after[stop.job_id].assignment, stopping=True)
    for assignment in (*result.rebound, *result.start):
        after[assignment.job_id] = RunnerView(
            assignment, stopping=assignment.job_id in after and after[assignment.job_id].stopping)
    assert situation.plan(after) == RunnerPlan()
    # What is left running (not stopping) is exactly what is desired.
    for job_id, runner in after.items():
        if not runner.stopping:
            assert situation.desired.get(job_id) == runner.assignment
