"""A node's pace (agent.progress.node_paces): at each step its slowest rank's, from the
ranks' progress reports, into the status the coordinator compares nodes with."""

from __future__ import annotations

from agent.progress import NODE_PACE_STEPS, node_paces, summarize_progress
from checkpoints.protocol.progress import ProgressReport
from rendezvous.records import JobNodeState, JobNodeStatus


def test_each_step_takes_the_slowest_rank_and_only_steps_every_rank_reported():
    reports = [
        ProgressReport(rank=0, restart_count=0, paces=((1, 0.5), (2, 0.5), (3, 0.5))),
        ProgressReport(rank=1, restart_count=0, paces=((2, 0.9), (3, 0.4))),
    ]
    assert node_paces(reports) == ((2, 0.9), (3, 0.5))
    assert summarize_progress(reports).paces == ((2, 0.9), (3, 0.5))


def test_ranks_without_paces_and_an_old_round_do_not_count():
    reports = [
        ProgressReport(rank=0, restart_count=1, paces=((5, 1.0),)),
        ProgressReport(rank=1, restart_count=1),  # a script not on the library's Checkpointer
        ProgressReport(rank=0, restart_count=0, paces=((5, 9.0),)),  # the round before
    ]
    assert summarize_progress(reports).paces == ((5, 1.0),)
    assert node_paces([]) == ()


def test_the_status_keeps_at_most_the_last_steps_a_node_reports():
    many = tuple((s, 0.1) for s in range(200))
    paces = node_paces([ProgressReport(rank=0, paces=many[-64:])])
    assert len(paces) == NODE_PACE_STEPS
    status = JobNodeStatus(job_id="j", node_id="n", state=JobNodeState.RUNNING,
                           paces=list(paces))
    assert JobNodeStatus.model_validate_json(status.model_dump_json()).paces == list(paces)
