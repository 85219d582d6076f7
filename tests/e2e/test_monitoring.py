"""A real Prometheus scrapes a real local tidal cluster while a job loses and gains a node.

The slow test runs examples/mlp.py on a three-node `LocalCluster`, with a
Prometheus (Debian's package) scraping the coordinator and every agent each
second, loading deploy/prometheus/tidal-alerts.yml, and asks Prometheus's HTTP
API what an operator's dashboard would show: the world size drops when a node
is killed and rises when one joins, restarts are counted with the right
reason, recoveries are timed, the checkpoint age resets after each save, every
Grafana panel's query evaluates without error (the core ones with data) and
every alerting rule evaluates. The other test runs `tidal up --prometheus` as
a user does and checks that its Prometheus scrapes the whole cluster and stops
with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd.server import free_port
from service.up.cluster import LocalCluster
from service.up.prometheus import RULES_FILE, render_config, target_of, write_targets
from tests.support.dashboard import load_dashboard, queries
from tests.support.processes import ProcessGroupRegistry, group_members
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"
WAIT_S = 90.0
# Panels that must show data once the job has lost and regained a node.
CORE_PANELS = (
    "Jobs by phase", "Nodes", "World size per job", "Throughput per job", "Restarts by reason",
    "Restarts decided by the scheduler", "Recovery duration (mean over 30m)", "Checkpoint age",
    "Checkpoint save and training stall", "Node health",
)


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("prometheus is not on PATH: install Debian's prometheus package "
                    "(bash .ci/system-deps.sh; CI does)")
    return found


class Prometheus:
    """Queries one Prometheus server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (vector or scalar, as a list).

        Raises:
            AssertionError: Prometheus answered with an error (bad PromQL, say).
        """
        response = self.http.get("/api/v1/query", params={"query": expr})
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (
            f"query {expr!r}: {response.status_code} {body}"
        )
        result = body["data"]["result"]
        if body["data"]["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def values(self, expr: str, by: str | None = None) -> dict[str, float]:
        """``{label value (or ""): sample value}`` of an instant query."""
        return {r["metric"].get(by, "") if by else "": float(r["value"][1])
                for r in self.query(expr)}

    def value(self, expr: str) -> float | None:
        found = self.values(expr)
        return found.get("")

    def range_values(self, expr: str, *, seconds: float) -> list[float]:
        end = time.time()
        response = self.http.get("/api/v1/query_range", params={
            "query": expr, "start": end - seconds, "end": end, "step": 1})
        body = response.json()
        assert body["status"] == "success", body
        return [float(v) for series in body["data"]["result"] for _, v in series["values"]]

    def close(self) -> None:
        self.http.close()


def start_prometheus(
    procs: ProcessGroupRegistry, directory: Path, *, coordinator: str, agents: list[str]
) -> tuple[Prometheus, Path]:
    """A Prometheus on a free loopback port scraping every second; returns it and its targets."""
    binary = prometheus_binary()
    directory.mkdir(parents=True)
    targets = directory / "agents.json"
    write_targets(targets, agents)
    config = directory / "prometheus.yml"
    config.write_text(render_config(coordinator=coordinator, agents_file=targets,
                                    scrape_interval_s=1, rule_files=[RULES_FILE]))
    log_path = directory / "prometheus.log"
    for _attempt in range(3):
        port = free_port()
        proc = procs.spawn([
            binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ], log_path=log_path)
        url = f"http://127.0.0.1:{port}"

        def ready(proc: subprocess.Popen[bytes] = proc, url: str = url) -> bool:
            if proc.poll() is not None:
                return True
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200

        wait_for(ready, timeout=30, what="Prometheus to be ready")
        if proc.poll() is None:
            return Prometheus(url), targets
        if "address already in use" not in log_path.read_text():
            break
    pytest.fail(f"Prometheus did not start:\n{log_path.read_text()[-3000:]}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(state_dir=tmp_path / "state", agents=3, workdir_root=REPO,
                         ready_timeout_s=60, stop_grace_s=10)
    try:
        local.start()
        yield local
    finally:
        local.stop()


def submit_mlp(cluster: LocalCluster) -> str:
    spec = {
        "name": "mlp",
        "command": [sys.executable, str(MLP), "--total-steps", "1000000", "--every-steps", "5",
                    "--step-seconds", "0.2"],
        "working_dir": ".",
        "checkpoint_dir": "mlp",
        "env": {"OMP_NUM_THREADS": "1"},  # three workers share two cores
        "min_nodes": 2,
        "max_nodes": 3,
        "grace_period_s": 10,
    }
    with cluster.client() as http:
        response = http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id: str = response.json()["job_id"]
    return job_id


def agent_targets(cluster: LocalCluster) -> list[str]:
    return [f"127.0.0.1:{a.metrics_port}" for a in cluster.describe().agents]


def wait_world_size(prom: Prometheus, job: str, size: int, cluster: LocalCluster) -> None:
    """Every scraped agent running the job reports world size ``size``."""
    expr = f'tidal_agent_job_world_size{{job_id="{job}"}}'

    def settled() -> bool:
        sizes = list(prom.values(expr, by="instance").values())
        return len(sizes) == size and set(sizes) == {size}

    try:
        wait_for(settled, timeout=WAIT_S, what=f"Prometheus to see world size {size}",
                 interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{prom.values(expr, by='instance')}\n"
                             f"{runner_logs(cluster)}") from exc


def runner_logs(cluster: LocalCluster) -> str:
    """The tail of every runner's log, for an error message."""
    return "\n".join(child_tail(p) for p in sorted(cluster.run_root.rglob("runner.log")))


def worker_of(cluster: LocalCluster, node_id: str) -> int:
    """The pid of a training worker that ``node_id`` of this cluster runs.

    A worker descends from its node's agent, whose command line names the
    node's run directory. (Its environment in /proc is no marker: a worker
    forked by a warm runner's zygote shows the agent's.)
    """
    run_dir = str(cluster.run_root / node_id).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(MLP).encode() in cmdline and b"worker_shim" not in cmdline and any(
            run_dir + b" " in ancestor + b" " for ancestor in _ancestors(int(entry.name))
        ):
            return int(entry.name)
    raise AssertionError(f"no worker of {node_id} found")


def _ancestors(pid: int) -> Iterator[bytes]:
    """The command lines of ``pid``'s parent, grandparent, ... up to init."""
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            yield Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return


def child_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- {path} ---\n" + "\n".join(text)


def restarts(prom: Prometheus, job: str) -> dict[str, float]:
    return prom.values(f'max by (reason) (tidal_agent_job_restarts_total{{job_id="{job}"}})',
                       by="reason")


def checkpoint_times(prom: Prometheus, job: str) -> float | None:
    return prom.value(f'max(tidal_agent_job_last_checkpoint_time_seconds{{job_id="{job}"}})')


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prometheus_sees_the_job_shrink_grow_restart_and_checkpoint(
    tmp_path: Path, procs: ProcessGroupRegistry, cluster: LocalCluster
) -> None:
    prom, targets = start_prometheus(procs, tmp_path / "prometheus",
                                     coordinator=target_of(cluster.url),
                                     agents=agent_targets(cluster))
    job = submit_mlp(cluster)
    wait_world_size(prom, job, 3, cluster)
    assert restarts(prom, job) == dict.fromkeys(
        ("worker_failed", "node_lost", "node_joined", "membership_changed", "scaled"), 0.0)
    wait_for(lambda: prom.value(f'max(tidal_agent_job_samples_per_second{{job_id="{job}"}})'),
             timeout=30, what="the job's throughput", interval=0.5)

    # The checkpoint age resets after each save: the newest checkpoint's time moves on.
    first = wait_for(lambda: checkpoint_times(prom, job), timeout=30,
                     what="a checkpoint in Prometheus", interval=0.5)
    wait_for(lambda: (checkpoint_times(prom, job) or 0) > first, timeout=30,
             what="a newer checkpoint", interval=0.5)
    age = prom.value(f'time() - max(tidal_agent_job_last_checkpoint_time_seconds'
                     f'{{job_id="{job}"}})')
    assert age is not None and age < 10, age

    # A node dies: the world size drops to 2, the survivors count a node_lost restart.
    victim = cluster.node_ids[-1]
    victim_target = f"127.0.0.1:{cluster.describe().agents[-1].metrics_port}"
    cluster.kill_agent(victim)
    wait_world_size(prom, job, 2, cluster)
    wait_for(lambda: restarts(prom, job).get("node_lost", 0) >= 1, timeout=30,
             what="a node_lost restart", interval=0.5)
    wait_for(lambda: prom.value(f'sum(tidal_agent_job_recovery_seconds_count'
                                f'{{job_id="{job}",reason="node_lost"}})'),
             timeout=30, what="a timed node_lost recovery", interval=0.5)
    wait_for(lambda: prom.value("max(tidal_coordinator_nodes_lost_total)") == 1, timeout=30,
             what="the coordinator to count a lost node", interval=0.5)
    # The coordinator counts it from the survivors' status records, a scrape
    # or two after the agents do.
    wait_for(lambda: prom.value(f'max(tidal_coordinator_job_restarts_total'
                                f'{{job_id="{job}",reason="node_lost"}})') == 1,
             timeout=30, what="the coordinator to count the node_lost restart", interval=0.5)
    wait_for(lambda: prom.value(f'up{{job="tidal-agent",instance="{victim_target}"}}') == 0,
             timeout=30, what="Prometheus to see the dead agent down", interval=0.5)

    # A node joins: the world size rises to 3, counted as node_joined.
    cluster.add_agent()
    write_targets(targets, [*agent_targets(cluster), victim_target])
    wait_world_size(prom, job, 3, cluster)
    wait_for(lambda: restarts(prom, job).get("node_joined", 0) >= 1, timeout=30,
             what="a node_joined restart", interval=0.5)
    wait_for(lambda: prom.value(f'sum(tidal_agent_job_recovery_seconds_count'
                                f'{{job_id="{job}",reason="node_joined"}})'),
             timeout=30, what="a timed node_joined recovery", interval=0.5)
    counted = restarts(prom, job)
    assert counted["worker_failed"] == 0 and counted["scaled"] == 0, counted

    # A worker is killed: a worker_failed restart at the same size, its exit code counted.
    # Its node must be done with the join first: a failure before the new workers'
    # first step extends the recovery under way, which stays a node_joined one.
    node = cluster.node_ids[0]
    port = next(a.metrics_port for a in cluster.describe().agents if a.node_id == node)
    wait_for(lambda: prom.value(f'sum(tidal_agent_job_recovery_seconds_count{{job_id="{job}",'
                                f'reason="node_joined",instance="127.0.0.1:{port}"}})'),
             timeout=30, what=f"{node}'s own recovery from the join", interval=0.5)
    os.kill(worker_of(cluster, node), signal.SIGKILL)
    try:
        wait_for(lambda: restarts(prom, job).get("worker_failed", 0) >= 1, timeout=30,
                 what="a worker_failed restart", interval=0.5)
        wait_for(lambda: prom.value(f'sum(tidal_agent_job_worker_exits_total'
                                    f'{{job_id="{job}",code="-9"}})') == 1,
                 timeout=30, what="the killed worker's exit code", interval=0.5)
        wait_for(lambda: prom.value(f'sum(tidal_agent_job_recovery_seconds_count'
                                    f'{{job_id="{job}",reason="worker_failed"}})'),
                 timeout=40, what="a timed worker_failed recovery", interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{runner_logs(cluster)}") from exc
    wait_world_size(prom, job, 3, cluster)

    # The user scales the job down to world size 2: the coordinator counts it; the
    # node released leaves as a drained one does, and no runner is replaced for
    # the new bounds (the agents' "scaled" count stays 0).
    with cluster.client() as http:
        http.patch(f"/v1/jobs/{job}", json={"max_nodes": 2}).raise_for_status()
    wait_world_size(prom, job, 2, cluster)
    wait_for(lambda: prom.value(f'max(tidal_coordinator_job_restarts_total'
                                f'{{job_id="{job}",reason="scaled_by_user"}})') == 1,
             timeout=30, what="the coordinator to count the scale-down", interval=0.5)
    assert restarts(prom, job).get("scaled", 0) == 0
    recovery = prom.values(
        f'max by (reason) (tidal_agent_job_recovery_seconds_sum{{job_id="{job}"}} '
        f'/ tidal_agent_job_recovery_seconds_count{{job_id="{job}"}})', by="reason")
    assert all(0 < seconds < WAIT_S for seconds in recovery.values()), recovery
    latest = checkpoint_times(prom, job) or 0
    wait_for(lambda: (checkpoint_times(prom, job) or 0) > latest, timeout=30,
             what="a checkpoint at the new size", interval=0.5)

    # The operator's view: every panel evaluates, the core ones with data; every rule runs.
    with_data: dict[str, bool] = {}
    for query in queries(load_dashboard(), job_id=job):
        found = bool(prom.query(query.expr))  # raises on an error
        with_data[query.panel] = with_data.get(query.panel, False) or found
    assert not [p for p in CORE_PANELS if not with_data.get(p)], with_data
    rules = prom.http.get("/api/v1/rules").json()["data"]["groups"]
    unhealthy = [(r["name"], r.get("lastError")) for g in rules for r in g["rules"]
                 if r["health"] != "ok"]
    assert rules and not unhealthy, unhealthy
    prom.close()


@pytest.mark.slow  # 60 s under load: tidal up with Prometheus
@pytest.mark.timeout(120)
def test_up_with_prometheus_scrapes_the_cluster_and_stops_with_it(
    tmp_path: Path, procs: ProcessGroupRegistry
) -> None:
    prometheus_binary()
    state = tmp_path / "state"
    log_path = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    up = procs.spawn([sys.executable, "-m", "service.cli", "up", "--agents", "2", "--prometheus",
                      "--state-dir", str(state)], log_path=log_path, env=env, cwd=REPO)

    def announced() -> str | None:
        if up.poll() is not None:
            pytest.fail(f"tidal up exited with {up.returncode}:\n{log_path.read_text()}")
        for line in log_path.read_text().splitlines():
            if line.strip().startswith("prometheus: http://"):
                return line.split()[1]
        return None

    url = wait_for(announced, timeout=60, what="tidal up to print the Prometheus URL")
    cluster = json.loads((state / "cluster.json").read_text())
    prom = Prometheus(url)
    expected = {target_of(cluster["url"])} | {
        f"127.0.0.1:{a['metrics_port']}" for a in cluster["agents"]}

    def all_up() -> bool:
        return prom.values('up == 1', by="instance").keys() == expected

    wait_for(all_up, timeout=30, what="Prometheus to scrape the coordinator and both agents",
             interval=0.5)
    assert prom.values("tidal_agent_info", by="node_id").keys() == {"node-1", "node-2"}
    assert prom.value("max(tidal_coordinator_leader)") == 1
    groups = prom.http.get("/api/v1/rules").json()["data"]["groups"]
    assert {g["name"] for g in groups} == {"tidal-jobs", "tidal-nodes"}
    prom.close()

    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=40) == 0, log_path.read_text()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/-/ready", timeout=2)
    pids = [cluster["coordinator_pid"], cluster["etcd_pid"], *(a["pid"] for a in cluster["agents"])]
    for pid in pids:
        wait_for(lambda pid=pid: not group_members(pid), timeout=5,
                 what=f"process group {pid} to be empty")
    assert not processes_mentioning(str(state / "prometheus"))


def processes_mentioning(text: str) -> list[str]:
    """Live processes (not zombies) whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and text.encode() in cmdline:
            words = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {words}")
    return found
