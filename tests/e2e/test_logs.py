"""Logs from anywhere: a real coordinator reads a job's output from real agents.

The agents serve their run directories' log files behind a token of their
node record (agent.node.logserve); the coordinator streams them to any client
(service.coordinator.routes.logs) with its own token. The reader here runs in another working
directory, with no cluster file: only the coordinator's URL and token.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.registry import NodeInfo
from service.client import Client
from tests.support.agents import AgentCluster
from tests.support.coordinator import TOKEN, CoordinatorProcess, coordinator_and_agents, job_view
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

PRINT_LINES = ("import os\n"
               "for i in range(5):\n"
               "    print(f'line {i} of rank {os.environ[\"RANK\"]}')\n")


@pytest.fixture
def cluster(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    yield from _cluster(tmp_path, etcd_server, etcd_root, procs)


def _cluster(tmp_path: Path, etcd_server: EtcdServer, etcd_root: str,
             procs: ProcessGroupRegistry) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    with coordinator_and_agents(tmp_path=tmp_path, etcd_server=etcd_server,
                                etcd_root=etcd_root, procs=procs) as both:
        yield both


def _node_record(etcd_server: EtcdServer, etcd_root: str, node_id: str) -> NodeInfo:
    with create_client(EtcdConfig(endpoints=[etcd_server.endpoint], root=etcd_root)) as client:
        kv = client.get(client.keys.node(node_id))
    assert kv is not None, f"node {node_id} is not registered"
    return NodeInfo.model_validate_json(kv.value)


def _submit(api: httpx.Client, **spec: object) -> str:
    response = api.post("/v1/jobs", json={"name": "logs", "max_restarts": 0, **spec})
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def _tidal(*args: str, url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update(TIDAL_URL=url, TIDAL_TOKEN=TOKEN, TIDAL_HOME=str(cwd / "home"))
    return subprocess.run([sys.executable, "-m", "service.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_logs_are_read_through_the_coordinator_authenticated_big_and_after_a_node_is_gone(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster],
    etcd_server: EtcdServer, etcd_root: str,
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent("a")
    agents.start_agent("b")
    wait_for(lambda: len(api.get("/v1/nodes").json()) == 2, timeout=30, what="agents a and b")
    job = _submit(api, command=[sys.executable, "-c", PRINT_LINES], min_nodes=2, max_nodes=2)
    wait_for(lambda: job_view(api, job)["phase"] == "SUCCEEDED", timeout=120,
             what=f"job {job} succeeded")

    with Client(coordinator.url, TOKEN) as client:
        lines = list(client.logs(job))
        by_node = {node: [ln for ln in lines if ln.startswith(f"[{node} r0] ")]
                   for node in ("a", "b")}
        for node, got in by_node.items():
            assert len(got) == 5, lines
            assert got[0].startswith(f"[{node} r0] line 0 of rank "), lines
        assert list(client.logs(job, node="b", rank=0, tail=2)) == by_node["b"][-2:]
        assert list(client.logs(job, rank=1)) == []  # one worker per node: local rank 0 only

    # From another directory, with nothing but the coordinator's URL and token.
    elsewhere = tmp_path / "laptop"
    (elsewhere / "home").mkdir(parents=True)
    result = _tidal("logs", job, "--node", "a", "--tail", "1", url=coordinator.url, cwd=elsewhere)
    assert result.returncode == 0, result
    assert result.stdout == by_node["a"][-1] + "\n"

    # Nothing is served without a credential, by the coordinator or by an agent.
    refused = httpx.get(f"{coordinator.url}/v1/jobs/{job}/logs", timeout=10)
    assert refused.status_code == 401 and "error" in refused.json()
    assert api.get("/v1/jobs/no-such-job/logs").status_code == 404
    record = _node_record(etcd_server, etcd_root, "a")
    assert record.logs is not None
    agent_url = f"{record.logs.url}/v1/jobs/{job}/logs"
    assert "token" not in json.dumps(api.get("/v1/nodes").json())
    assert httpx.get(agent_url, timeout=10).status_code == 401
    assert httpx.get(agent_url, headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=10).status_code == 401
    own = {"Authorization": f"Bearer {record.logs.token}"}
    assert httpx.get(agent_url, headers=own, timeout=10).status_code == 200
    bad_id = httpx.get(f"{record.logs.url}/v1/jobs/a%2F..%2Fb/logs", headers=own, timeout=10)
    assert bad_id.status_code == 422, bad_id.text

    # A large log streams through without being held whole: the first lines come
    # before the agent has sent it all, and neither process grows by its size.
    big = agents.workdir / "a" / "jobs" / job / "gen-99" / "logs" / "big" / "attempt_0" / "0"
    big.mkdir(parents=True)
    line = "x" * 1023 + "\n"
    count = 48 * 1024  # 48 MiB
    with open(big / "stdout.log", "w") as f:
        for _ in range(count // 1024):
            f.write(line * 1024)
    assert coordinator.process is not None
    agent_pid = agents.agents["a"].pid
    before = (_peak_rss_kib(coordinator.process.pid), _peak_rss_kib(agent_pid))
    seen = 0
    with Client(coordinator.url, TOKEN) as client:
        for big_line in client.logs(job, node="a"):
            seen += big_line.endswith("x" * 1023)
    after = (_peak_rss_kib(coordinator.process.pid), _peak_rss_kib(agent_pid))
    assert seen == count
    growth_mib = [(a - b) / 1024 for a, b in zip(after, before, strict=True)]
    print(f"peak RSS growth (coordinator, agent) for a 48 MiB log: {growth_mib} MiB")
    assert max(growth_mib) < 24, f"peak RSS grew by {growth_mib} MiB for a 48 MiB log"
    shutil.rmtree(big.parents[3])

    # A node that is gone says so, in-band; the others' logs are still there.
    agents.kill_agent("b")
    wait_for(lambda: [n["node_id"] for n in api.get("/v1/nodes").json()] == ["a"],
             timeout=30, what="node b's record expired")
    with Client(coordinator.url, TOKEN) as client:
        lines = list(client.logs(job, tail=1))
    assert "[tidal] node b is gone" in "\n".join(lines), lines
    assert by_node["a"][-1] in lines


PROGRESSING = (
    "import os, sys, time\n"
    "from checkpoints.progress import create_progress_reporter\n"
    "progress = create_progress_reporter(interval=0.1)\n"
    "progress.set_total_steps(1_000_000)\n"
    "print('started', flush=True)\n"
    "step = 0\n"
    "deadline = time.monotonic() + 150\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
    "    step += 1\n"
    "    progress.record(step=step, loss=1.0 / step, samples=32)\n"
    "    if step == 5:\n"
    "        progress.checkpoint_saved(step=5, wall_time=time.time(), save_seconds=0.1,\n"
    "                                  stall_seconds=0.01)\n"
    "    time.sleep(0.02)\n"
    "progress.flush()\n"
    "print('done', flush=True)\n"
)


def _established(port: int) -> int:
    """How many TCP connections to ``port`` on this machine are established."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                count += 1
    return count


def _read_all(fd: int, into: list[bytes]) -> None:
    """Read a pty's master side until its slave side is closed everywhere."""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: nothing has the terminal open any more
            return
        if not data:
            return
        into.append(data)


@pytest.mark.slow
def test_submit_streams_logs_and_progress_a_follow_ends_with_the_job_and_watch_draws_a_bar(
    tmp_path: Path, cluster: tuple[CoordinatorProcess, AgentCluster],
    etcd_server: EtcdServer, etcd_root: str,
) -> None:
    coordinator, agents = cluster
    api = coordinator.client()
    agents.start_agent("a")
    wait_for(lambda: api.get("/v1/nodes").json(), timeout=30, what="agent a")
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update(TIDAL_URL=coordinator.url, TIDAL_TOKEN=TOKEN, TIDAL_HOME=str(tmp_path / "home"))
    submit = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "submit", "--name", "progress",
         "--max-restarts", "0", "--", sys.executable, "-c", PROGRESSING, str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        start_new_session=True,
    )
    out: list[str] = []
    watcher: subprocess.Popen[bytes] | None = None
    master = -1
    try:
        assert submit.stdout is not None
        reader = threading.Thread(target=lambda: out.extend(submit.stdout or ()), daemon=True)
        reader.start()

        def progress_line() -> str | None:
            return next((ln for ln in list(out) if ln.startswith("progress: step ")
                         and "checkpoint" in ln and "left" in ln), None)

        # Plain lines when stdout is not a terminal: the logs and the progress.
        wait_for(lambda: "[a r0] started\n" in out, timeout=120, what="the job's first line")
        line = wait_for(progress_line, timeout=60, what="a progress line with an ETA")
        assert line is not None and "/1000000, " in line and "samples/s" in line, line
        assert "loss " in line and "world size 1" in line, line
        job = next(ln.split()[2] for ln in out if ln.startswith("submitted job "))

        # A client following the logs sees new lines and ends with the job.
        followed: list[str] = []
        ended = threading.Event()

        def follow() -> None:
            try:
                with Client(coordinator.url, TOKEN) as client:
                    followed.extend(client.logs(job, follow=True))
            finally:
                ended.set()

        threading.Thread(target=follow, daemon=True).start()
        wait_for(lambda: "[a r0] started" in followed, timeout=60, what="the followed log")

        # A follower that goes away closes the coordinator's stream from the agent too.
        endpoint = _node_record(etcd_server, etcd_root, "a").logs
        assert endpoint is not None
        port = int(endpoint.url.rsplit(":", 1)[1])
        streams = wait_for(lambda: _established(port), timeout=30, what="the agent's streams")
        with httpx.stream("GET", f"{coordinator.url}/v1/jobs/{job}/logs",
                          params={"follow": "true"}, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30) as response:
            assert next(ln for ln in response.iter_lines() if ln) == "[a r0] started"
            wait_for(lambda: _established(port) == streams + 1, timeout=30, what="a third")
        wait_for(lambda: _established(port) == streams, timeout=30,
                 what="the agent's stream of a follower that went away closed")

        # On a terminal, `status --watch` redraws a bar in place.
        master, slave = os.openpty()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "status", job, "--watch"],
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
            start_new_session=True,
        )
        os.close(slave)
        screen: list[bytes] = []
        pty_reader = threading.Thread(target=_read_all, args=(master, screen), daemon=True)
        pty_reader.start()
        wait_for(lambda: b"%  step " in b"".join(screen), timeout=60, what="a progress bar")
        go.touch()
        assert submit.wait(timeout=120) == 0, "".join(out)
        assert watcher.wait(timeout=120) == 0
        assert ended.wait(60), f"the followed log did not end with the job: {followed}"
        assert followed[followed.index("[a r0] started") + 1:] == ["[a r0] done"], followed
        pty_reader.join(timeout=10)
        reader.join(timeout=10)
    finally:
        for proc in (submit, watcher):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if master >= 0:
            os.close(master)
    drawn = b"".join(screen).decode(errors="replace")
    assert "\r\x1b[K[" in drawn and "world size 1" in drawn, drawn[-2000:]
    assert f"job {job} SUCCEEDED" in drawn
    text = "".join(out)
    assert "[a r0] done\n" in text and f"job {job} SUCCEEDED" in text, text
    assert "\r" not in text and "\x1b" not in text
