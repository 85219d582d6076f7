"""What the agent does once a job's runner has exited (agent.node.supervise), without etcd."""

from __future__ import annotations

from agent.node.supervise import Action, after_exit, describe_exit, signal_name
from agent.spec import EXIT_CRASHED, EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED, RunnerOutcome
from rendezvous.records import RUNNER_RANK, Assignment, JobNodeState, JobNodeStatus, WorkerError

JOB = Assignment(job_id="j", generation=2, command=["python", "t.py"], min_nodes=1,
                 max_nodes=2, max_restarts=2)


def _status(**fields: object) -> JobNodeStatus:
    base: dict[str, object] = {"job_id": "j", "node_id": "a", "generation": 2,
                               "state": JobNodeState.RUNNING, "remaining_restarts": 2,
                               "world_size": 2, "ranks": [0], "pid": 77}
    base.update(fields)
    return JobNodeStatus.model_validate(base)


def _after(code: int, reported: JobNodeStatus | None, **kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = {"assignment": JOB, "node_id": "a", "pid": 77, "code": code,
                               "stopping": False, "reported": reported}
    args.update(kw)
    return after_exit(**args)  # type: ignore[arg-type]


def test_a_runner_the_daemon_stopped_needs_nothing():
    assert _after(-9, _status(), stopping=True).action == Action.NOTHING


def test_a_runner_that_reported_its_end_needs_nothing():
    for state in (JobNodeState.SUCCEEDED, JobNodeState.FAILED, JobNodeState.CANCELLED):
        assert _after(-9, _status(state=state)).action == Action.NOTHING


def test_a_sigkilled_runner_with_budget_left_is_restarted_and_charged():
    after = _after(-9, _status(restart_count=1, restart_reasons={"node_lost": 1}))
    assert after.action == Action.RESTART
    st = after.status
    assert st is not None
    assert st.state == JobNodeState.RESTARTING
    assert st.remaining_restarts == 1
    assert st.restart_count == 2
    assert st.restart_reasons == {"node_lost": 1, "worker_failed": 1}
    assert st.last_restart_reason == "worker_failed"
    assert (st.world_size, st.ranks, st.pid) == (0, [], 0)
    assert st.error is not None
    assert st.error.rank == RUNNER_RANK
    assert st.error.signal == "SIGKILL"
    assert st.error.exit_code == -9
    assert "the runner (pid 77) was killed by SIGKILL" in st.error.message


def test_a_sigkilled_runner_without_budget_fails_the_job_with_the_cause():
    after = _after(-9, _status(remaining_restarts=0), log_tail="last words")
    assert after.action == Action.REPORT
    assert after.status is not None
    assert after.status.state == JobNodeState.FAILED
    assert after.status.remaining_restarts == 0
    assert after.status.restart_reasons == {"worker_failed": 1}
    assert after.status.error is not None
    assert after.status.error.traceback == "last words"


def test_a_runner_that_died_before_its_first_report_is_charged_from_the_assignment():
    after = _after(-11, None)
    assert after.action == Action.RESTART
    assert after.status is not None
    assert (after.status.job_id, after.status.node_id, after.status.generation) == ("j", "a", 2)
    assert after.status.remaining_restarts == JOB.max_restarts - 1


def test_a_report_of_another_generation_is_not_this_runners():
    old = _status(generation=1, state=JobNodeState.FAILED, remaining_restarts=0)
    after = _after(-9, old)
    assert after.action == Action.RESTART
    assert after.status is not None
    assert after.status.generation == 2


def test_a_crash_carries_the_runners_own_account():
    outcome = RunnerOutcome(pid=77, message="RuntimeError: boom", traceback="Traceback ...")
    after = _after(EXIT_CRASHED, _status(), outcome=outcome, log_tail="ignored")
    assert after.status is not None and after.status.error is not None
    assert after.status.error.message == (
        "the runner (pid 77) exited with code 4: RuntimeError: boom")
    assert after.status.error.traceback == "Traceback ..."
    assert after.status.error.signal is None


def test_a_lost_final_write_is_written_for_the_runner_uncharged():
    for code, state in ((EXIT_SUCCEEDED, JobNodeState.SUCCEEDED),
                        (EXIT_FAILED, JobNodeState.FAILED),
                        (EXIT_STOPPED, JobNodeState.CANCELLED)):
        after = _after(code, _status(remaining_restarts=1))
        assert after.action == Action.REPORT
        assert after.status is not None
        assert after.status.state == state
        assert after.status.remaining_restarts == 1
        assert after.status.restart_reasons == {}


def test_a_failure_keeps_the_workers_root_cause_if_the_runner_had_one():
    cause = WorkerError(rank=1, exit_code=1, message="ValueError: bad shard")
    after = _after(EXIT_FAILED, _status(error=cause))
    assert after.status is not None and after.status.error == cause
    outcome = RunnerOutcome(pid=77, message="working directory /w does not exist")
    after = _after(EXIT_FAILED, None, outcome=outcome)
    assert after.status is not None and after.status.error is not None
    assert after.status.error.message == "working directory /w does not exist"


def test_exit_descriptions():
    assert signal_name(0) is None and signal_name(3) is None
    assert signal_name(-15) == "SIGTERM"
    assert describe_exit(5, -9) == "the runner (pid 5) was killed by SIGKILL"
    assert describe_exit(5, 4) == "the runner (pid 5) exited with code 4"
