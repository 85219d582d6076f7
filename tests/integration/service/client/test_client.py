"""The Python client and its async twin against a real coordinator and agent (and a
real etcd): every method, the errors a user meets, and the examples in examples/
run as a user runs them.

One coordinator and one agent serve the module's tests (starting them is most of
a test's time); each test submits its own jobs and leaves none running, and puts
back the node it drains.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rendezvous.etcd.server import EtcdServer
from service.api.models import JobPhase
from service.client import (
    EXIT_JOB_CANCELLED,
    EXIT_JOB_FAILED,
    EXIT_TIMEOUT,
    AsyncClient,
    Client,
    ConflictError,
    InvalidRequestError,
    InvalidSpecError,
    JobCancelledError,
    JobFailedError,
    NotFoundError,
    UnauthorizedError,
    WaitTimeoutError,
)
from tests.support.agents import AgentCluster
from tests.support.coordinator import TOKEN, CoordinatorProcess
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[4]
HELLO = [sys.executable, "-c", "print('hello'); print('bye')"]
FAILS = [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]
SLEEPS = [sys.executable, "-c", "import time; time.sleep(600)"]


@dataclass
class Cluster:
    coordinator: CoordinatorProcess
    agents: AgentCluster

    @property
    def url(self) -> str:
        return self.coordinator.url

    def env(self) -> dict[str, str]:
        """A user's environment pointing at this cluster (and at no `tidal up` one)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        env.update(TIDAL_URL=self.url, TIDAL_TOKEN=TOKEN,
                   TIDAL_HOME=str(self.coordinator.workdir / "home"))
        return env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, etcd_server: EtcdServer
            ) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("client")
    root = f"/tidal-test-client-{os.getpid()}"
    procs = ProcessGroupRegistry()
    try:
        coordinator = CoordinatorProcess(etcd_endpoint=etcd_server.endpoint, etcd_root=root,
                                         workdir=workdir, procs=procs).start()
        agents = AgentCluster(etcd_endpoint=etcd_server.endpoint, etcd_root=root,
                              workdir=workdir / "agents", procs=procs)
        agents.workdir.mkdir()
        agents.start_agent("a", extra=("--slots", "2"))  # the sweep's two jobs at once
        both = Cluster(coordinator, agents)
        with Client(coordinator.url, TOKEN) as client:
            wait_for(client.nodes, timeout=60, what="agent a registered")
        try:
            yield both
        except BaseException:
            print(coordinator.log_tail(), agents.log_tails(), sep="\n")
            raise
    finally:
        procs.stop_all()


@pytest.mark.slow  # 22 s under load: jobs run by an agent
def test_the_client_drives_jobs_from_submit_to_their_end(cluster: Cluster) -> None:
    with Client(cluster.url, TOKEN) as tidal:
        [node] = tidal.nodes()
        assert (node.node_id, node.state) == ("a", "live")

        job = tidal.submit(name="hello", command=HELLO, max_restarts=0)
        assert job.phase == JobPhase.PENDING and job.job_id.startswith("hello-")
        assert tidal.get(job.job_id).spec.command == HELLO
        assert job.job_id in [v.job_id for v in tidal.list()]
        assert len(tidal.list_page(limit=1).jobs) == 1
        done = tidal.wait(job.job_id, timeout=120, check=True)
        assert done.phase == JobPhase.SUCCEEDED
        assert job.job_id in [v.job_id for v in tidal.list(phase="succeeded")]
        reasons = [e.reason.value for e in tidal.events(job.job_id).events]
        assert reasons[0] == "submitted" and tidal.events(job.job_id).events[-1].phase == (
            JobPhase.SUCCEEDED)
        lines = list(tidal.logs(job.job_id))
        assert "[a r0] hello" in lines and "[a r0] bye" in lines, lines
        assert list(tidal.logs(job.job_id, tail=1)) == ["[a r0] bye"]

        failing = tidal.submit(name="fails", command=FAILS, max_restarts=0)
        with pytest.raises(JobFailedError) as failed:
            tidal.wait(failing.job_id, timeout=120, check=True)
        assert failed.value.exit_code == EXIT_JOB_FAILED
        assert failed.value.view.error is not None and failed.value.view.error.exit_code == 3
        assert tidal.wait(failing.job_id).phase == JobPhase.FAILED  # no check: the view

        sleeper = tidal.submit(name="sleeps", command=SLEEPS)
        with pytest.raises(WaitTimeoutError) as timed_out:
            tidal.wait(sleeper.job_id, timeout=0.5)
        assert timed_out.value.exit_code == EXIT_TIMEOUT and timed_out.value.last is not None
        assert tidal.scale(sleeper.job_id, max_nodes=2).spec.max_nodes == 2
        with pytest.raises(InvalidRequestError, match=r"min_nodes \(3\) is greater"):
            tidal.scale(sleeper.job_id, min_nodes=3, max_nodes=1)
        assert tidal.cancel(sleeper.job_id).cancel_requested
        with pytest.raises(JobCancelledError) as cancelled:
            tidal.wait(sleeper.job_id, timeout=120, check=True)
        assert cancelled.value.exit_code == EXIT_JOB_CANCELLED
        with pytest.raises(ConflictError, match="already CANCELLED"):
            tidal.cancel(sleeper.job_id)

        assert tidal.drain("a").state == "draining"
        assert tidal.undrain("a").state == "live"
        with pytest.raises(NotFoundError, match="node nope is not registered"):
            tidal.drain("nope")
        with pytest.raises(NotFoundError):
            tidal.get("nope-00000000")
        with pytest.raises(NotFoundError):
            list(tidal.logs("nope-00000000"))
        with pytest.raises(InvalidSpecError):
            tidal.submit(name="bad", command=HELLO, min_nodes=0)
    with Client(cluster.url, "wrong-token-0123456789") as stranger, \
            pytest.raises(UnauthorizedError):
        stranger.list()


@pytest.mark.slow  # 19 s under load: jobs run by an agent
def test_the_async_client_is_the_same_client_awaited(cluster: Cluster) -> None:
    async def run() -> None:
        async with AsyncClient(cluster.url, TOKEN) as tidal:
            assert [n.node_id for n in await tidal.nodes()] == ["a"]
            job = await tidal.submit(name="hello-async", command=HELLO, max_restarts=0)
            got, listed, events = await asyncio.gather(
                tidal.get(job.job_id), tidal.list(), tidal.events(job.job_id))
            assert got.job_id == job.job_id and job.job_id in [v.job_id for v in listed]
            assert events.events[0].reason.value == "submitted"
            followed = [line async for line in tidal.logs(job.job_id, follow=True)]
            assert "[a r0] hello" in followed and "[a r0] bye" in followed, followed
            done = await tidal.wait(job.job_id, timeout=120, check=True)
            assert done.phase == JobPhase.SUCCEEDED
            assert [line async for line in tidal.logs(job.job_id, rank=0, tail=1)] == [
                "[a r0] bye"]

            sleeper = await tidal.submit(name="sleeps-async", command=SLEEPS)
            with pytest.raises(WaitTimeoutError):
                await tidal.wait(sleeper.job_id, timeout=0.5)
            assert (await tidal.scale(sleeper.job_id, max_nodes=3)).spec.max_nodes == 3
            assert (await tidal.cancel(sleeper.job_id)).cancel_requested
            with pytest.raises(JobCancelledError):
                await tidal.wait(sleeper.job_id, timeout=120, check=True)
            with pytest.raises(ConflictError):
                await tidal.scale(sleeper.job_id, max_nodes=1)

            assert (await tidal.drain("a")).state == "draining"
            assert (await tidal.undrain("a")).state == "live"
            with pytest.raises(NotFoundError):
                await tidal.get("nope-00000000")
        async with AsyncClient(cluster.url, "wrong-token-0123456789") as stranger:
            with pytest.raises(UnauthorizedError):
                await stranger.nodes()

    asyncio.run(run())


def _example(name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, check=False,
    )


@pytest.mark.slow  # two example runs and three jobs, each a Python process started by a runner
def test_the_examples_submit_wait_and_print_logs(cluster: Cluster) -> None:
    env = cluster.env()
    result = _example("client_submit.py", env=env)
    assert result.returncode == 0, f"{result}\n{cluster.agents.log_tails()}"
    out = result.stdout
    assert "[a r0] hello from rank 0 of 1" in out.splitlines(), out
    assert out.splitlines()[-1].endswith(" SUCCEEDED"), out

    sweep = _example("client_async.py", "--values", "x", "y", env=env)
    assert sweep.returncode == 0, f"{sweep}\n{cluster.agents.log_tails()}"
    lines = sweep.stdout.splitlines()
    assert "x: [a r0] hello, value x" in lines and "y: [a r0] hello, value y" in lines, lines
    assert lines[-3].split() == ["VALUE", "JOB", "PHASE"]
    assert [line.split()[::2] for line in lines[-2:]] == [["x", "SUCCEEDED"],
                                                          ["y", "SUCCEEDED"]]

    unconfigured = {k: v for k, v in env.items() if k not in ("TIDAL_URL", "TIDAL_TOKEN")}
    nowhere = _example("client_submit.py", env=unconfigured)
    assert nowhere.returncode == 6 and "no tidal coordinator configured" in nowhere.stderr
