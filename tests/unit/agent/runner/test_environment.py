"""The environment a runner gives its zygote and workers (agent.runner.__main__):
a job's zygote_preload reaches the zygote, and a warm runner's zygote, started
before the job was known, is replaced for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.runner.__main__ import import_time_differences, prepare_environment
from agent.spec import RunnerSpec
from checkpoints.protocol import env as worker_env
from rendezvous.etcd import EtcdConfig
from rendezvous.records import Assignment


@pytest.fixture
def saved_environ() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _spec(tmp_path: Path, **assignment: object) -> RunnerSpec:
    return RunnerSpec(
        assignment=Assignment(job_id="j", command=["python", "t.py"], min_nodes=1, max_nodes=1,
                              **assignment),  # type: ignore[arg-type]
        node_id="n1", address="127.0.0.1", etcd=EtcdConfig(), job_dir=tmp_path, parent_pid=1,
    )


@pytest.mark.usefixtures("saved_environ")
def test_a_jobs_preload_list_reaches_its_zygote_and_replaces_a_warm_one(tmp_path: Path) -> None:
    os.environ.pop(worker_env.ZYGOTE_PRELOAD, None)
    warm_zygote_env = dict(os.environ)  # what a warm runner's zygote was started with
    prepare_environment(_spec(tmp_path, zygote_preload=["transformers", "lightning.pytorch"]))
    assert os.environ[worker_env.ZYGOTE_PRELOAD] == "transformers,lightning.pytorch"
    # The warm runner compares the two and starts a zygote with the job's environment.
    assert import_time_differences(warm_zygote_env, dict(os.environ)) == [
        worker_env.ZYGOTE_PRELOAD
    ]


@pytest.mark.usefixtures("saved_environ")
def test_a_job_without_a_preload_list_keeps_the_warm_zygote(tmp_path: Path) -> None:
    os.environ.pop(worker_env.ZYGOTE_PRELOAD, None)
    warm_zygote_env = dict(os.environ)
    prepare_environment(_spec(tmp_path))
    assert worker_env.ZYGOTE_PRELOAD not in os.environ
    assert import_time_differences(warm_zygote_env, dict(os.environ)) == []
