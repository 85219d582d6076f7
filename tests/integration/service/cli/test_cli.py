"""The `tidal` job commands end to end: a real etcd, a real coordinator (and agent),
and the command line run as subprocesses, as a user or a script runs it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd.server import EtcdServer
from service.client import TargetError, resolve_target
from tests.support.agents import AgentCluster
from tests.support.coordinator import wait_for_url
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

TOKEN = "cli-test-token-0123456789abcdef"
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*-[0-9a-f]{8}$")


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any TIDAL_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update(extra)
    return env


@dataclass
class Coordinator:
    url: str
    token_file: Path
    log: Path
    home: Path  # an empty TIDAL_HOME, so no real ~/.tidal is ever read

    def env(self, **extra: str) -> dict[str, str]:
        return _clean_env(**{"TIDAL_URL": self.url, "TIDAL_TOKEN": TOKEN,
                             "TIDAL_HOME": str(self.home), **extra})

    def get(self, path: str) -> Any:
        response = httpx.get(self.url + path, headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=5)
        response.raise_for_status()
        return response.json()


@pytest.fixture
def coordinator(
    procs: ProcessGroupRegistry, etcd_server: EtcdServer, etcd_root: str, tmp_path: Path
) -> Iterator[Coordinator]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    log = tmp_path / "coordinator.log"
    argv = [
        sys.executable, "-m", "service.cli", "coordinator",
        "--etcd", etcd_server.endpoint, "--etcd-root", etcd_root,
        "--port", "0", "--token-file", str(token_file),
        "--workdir-root", str(tmp_path), "--checkpoint-root", str(tmp_path / "checkpoints"),
        "--election-ttl", "2", "--ready-file", str(tmp_path / "coordinator.ready.json"),
    ]
    proc = procs.spawn(argv, log_path=log, env=_clean_env(TIDAL_RECONCILE_INTERVAL_S="0.5"))
    url = wait_for_url(proc, tmp_path / "coordinator.ready.json", log_path=log)
    home = tmp_path / "home"
    home.mkdir()
    yield Coordinator(url=url, token_file=token_file, log=log, home=home)


def tidal(*args: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the command line to completion (killed if it overruns ``timeout``)."""
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    assert "Traceback" not in result.stderr
    return result.stdout


def clean_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    """The command failed with ``code``, one ``error:`` line naming ``text``, no traceback."""
    assert result.returncode == code, (
        f"exit {result.returncode}, wanted {code}\nstdout:\n{result.stdout}\n"
        f"stderr:\n{result.stderr}"
    )
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.startswith("error: "), result.stderr
    assert text in result.stderr, result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_cluster_file(
    state_dir: Path, coordinator: Coordinator, agents: dict[str, tuple[int, Path]]
) -> None:
    """What `tidal up` writes, pointing at the test's coordinator and agents."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "cluster.json").write_text(json.dumps({
        "url": coordinator.url,
        "token_file": str(coordinator.token_file),
        "etcd_endpoint": None,
        "etcd_root": None,
        "state_dir": str(state_dir),
        "coordinator_pid": None,
        "etcd_pid": None,
        "agents": [{"node_id": node, "pid": pid, "run_dir": str(run_dir), "metrics_port": None}
                   for node, (pid, run_dir) in agents.items()],
    }))


@pytest.mark.slow  # 21 s under load: a CLI process per command
def test_job_commands_print_tables_and_json_and_refuse_what_the_api_refuses(
    coordinator: Coordinator,
) -> None:
    env = coordinator.env()
    out = ok(tidal("submit", "--no-wait", "--name", "cli-a", "--min-nodes", "1",
                   "--max-nodes", "2", "--env", "SECRET=hunter2", "--label", "zone=a",
                   "--", sys.executable, "-c", "pass", env=env))
    job = out.strip()
    assert JOB_ID_RE.match(job) and job.startswith("cli-a-"), out

    listing = ok(tidal("jobs", env=env))
    assert listing.splitlines()[0].split()[:3] == ["JOB", "PHASE", "NODES"]
    assert re.search(rf"^{re.escape(job)}\s+PENDING\s+0 \(1\.\.2\)", listing, re.M), listing
    data = json.loads(ok(tidal("jobs", "--json", "--phase", "pending", env=env)))
    assert [j["job_id"] for j in data["jobs"]] == [job]
    assert [j["job_id"] for j in json.loads(ok(tidal("jobs", "--all", "--json", env=env)))
            ["jobs"]] == [job]

    status = ok(tidal("status", job, env=env))
    assert re.search(r"^phase:\s+PENDING$", status, re.M), status
    assert "SECRET" in status and "hunter2" not in status
    view = json.loads(ok(tidal("status", job, "--json", env=env)))
    assert (view["job_id"], view["phase"], view["spec"]["node_selector"]) == (
        job, "PENDING", {"zone": "a"})

    events = ok(tidal("events", job, env=env))
    assert events.splitlines()[0].split()[:4] == ["SEQ", "TIME", "PHASE", "REASON"]
    assert "submitted" in events
    assert json.loads(ok(tidal("events", job, "--json", env=env)))["events"][0]["reason"] == (
        "submitted")

    nodes = tidal("nodes", env=env)
    assert ok(nodes) == "" and "no nodes" in nodes.stderr

    assert "1..3 node(s)" in ok(tidal("scale", job, "--min", "1", "--max", "3", env=env))
    scaled = json.loads(ok(tidal("scale", job, "--max", "4", "--json", env=env)))
    assert (scaled["spec"]["min_nodes"], scaled["spec"]["max_nodes"]) == (1, 4)
    assert coordinator.get(f"/v1/jobs/{job}/events")["events"][-1]["reason"] == "scaled_by_user"
    clean_error(tidal("scale", job, "--min", "3", "--max", "1", env=env), 4,
                "min_nodes (3) is greater than max_nodes (1)")
    missing = tidal("scale", job, env=env)
    assert missing.returncode == 2 and "--min, --max or both" in missing.stderr

    assert f"cancelling job {job}" in ok(tidal("cancel", job, env=env))
    wait_for(lambda: coordinator.get(f"/v1/jobs/{job}")["phase"] == "CANCELLED",
             timeout=20, what=f"{job} CANCELLED")
    clean_error(tidal("scale", job, "--min", "2", env=env), 4, "cannot be scaled")
    clean_error(tidal("cancel", job, env=env), 4, "already CANCELLED")
    watched = tidal("status", job, "--watch", env=env)
    assert watched.returncode == 3 and f"job {job} CANCELLED" in watched.stdout, watched

    clean_error(tidal("status", "no-such-job", env=env), 4, "no-such-job")
    clean_error(tidal("submit", "--min-nodes", "3", "--max-nodes", "1", "--", "true", env=env),
                2, "min_nodes (3) is greater than max_nodes (1)")
    clean_error(tidal("jobs", env=coordinator.env(TIDAL_TOKEN="wrong-token-0123456789")), 4,
                "missing or wrong bearer token")
    # The token file works as well as the token, and --url beats TIDAL_URL.
    by_file = _clean_env(TIDAL_TOKEN_FILE=str(coordinator.token_file),
                         TIDAL_URL="http://127.0.0.1:1", TIDAL_HOME=str(coordinator.home))
    assert job in ok(tidal("jobs", "--url", coordinator.url, env=by_file))


def test_no_coordinator_unreachable_or_unconfigured_is_a_clean_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()  # closed again: nothing listens there
    started = time.monotonic()
    result = tidal("jobs", env=_clean_env(TIDAL_URL=f"http://127.0.0.1:{port}",
                                          TIDAL_TOKEN=TOKEN, TIDAL_HOME=str(home)))
    assert time.monotonic() - started < 10
    clean_error(result, 5, f"cannot reach the coordinator at http://127.0.0.1:{port}")

    clean_error(tidal("status", "some-job", env=_clean_env(TIDAL_HOME=str(home))), 6,
                "no tidal coordinator configured")
    clean_error(tidal("logs", "some-job", env=_clean_env(TIDAL_HOME=str(home))), 6,
                "no tidal coordinator configured")
    clean_error(tidal("jobs", "--url", "127.0.0.1:8470", env=_clean_env(TIDAL_HOME=str(home))),
                6, "must start with http:// or https://")
    bad_id = tidal("status", "../etc", env=_clean_env(TIDAL_HOME=str(home)))
    assert bad_id.returncode == 2 and "job id" in bad_id.stderr


@pytest.mark.slow  # 26 s under load: a job run by an agent
def test_submit_follows_a_job_to_success_and_logs_show_its_output(
    coordinator: Coordinator, procs: ProcessGroupRegistry, etcd_server: EtcdServer,
    etcd_root: str, tmp_path: Path,
) -> None:
    agents = AgentCluster(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                          workdir=tmp_path / "agents", procs=procs)
    agents.workdir.mkdir()
    agent = agents.start_agent("a")
    env = coordinator.env()
    wait_for(lambda: coordinator.get("/v1/nodes"), timeout=30, what="agent a registered")
    nodes = ok(tidal("nodes", env=env))
    assert re.search(r"^a\s+live\s+0/1", nodes, re.M), nodes
    assert json.loads(ok(tidal("nodes", "--json", env=env)))[0]["node_id"] == "a"

    result = tidal("submit", "--name", "hello", "--max-restarts", "0", "--",
                   sys.executable, "-c", "print('hello')", env=env, timeout=90)
    assert result.returncode == 0, f"{result}\n{agents.log_tails()}"
    assert "Traceback" not in result.stderr
    job = re.search(r"^submitted job (\S+) ", result.stdout, re.M).group(1)  # type: ignore[union-attr]
    assert re.search(r"PENDING\s+submitted", result.stdout), result.stdout
    assert f"job {job} SUCCEEDED" in result.stdout
    # The job's output streams while it is followed, through the coordinator.
    assert "[a r0] hello" in result.stdout.splitlines(), result.stdout

    state = tmp_path / "state"
    write_cluster_file(state, coordinator, {"a": (agent.pid, agents.workdir / "a")})
    logs_env = _clean_env(TIDAL_HOME=str(state))  # URL and token from the cluster file too
    assert "[a r0] hello" in ok(tidal("logs", job, env=logs_env)).splitlines()
    assert ok(tidal("logs", job, "--tail", "1", "--rank", "0", "--node", "a",
                    env=logs_env)) == "[a r0] hello\n"
    lines = [json.loads(line) for line in ok(tidal("logs", job, "--json", env=logs_env))
             .splitlines()]
    assert {"node": "a", "rank": 0, "line": "hello"} in lines
    # -f on a job that ended prints what there is and returns.
    assert "[a r0] hello" in ok(tidal("logs", job, "-f", env=logs_env, timeout=20))
    assert ok(tidal("logs", job, "--rank", "1", env=logs_env)) == ""
    assert f"[tidal] node zz is not registered and has not run job {job}" in ok(
        tidal("logs", job, "--node", "zz", env=logs_env))
    assert tidal("logs", job, "--node", "../x", env=logs_env).returncode == 2

    assert "node a is draining" in ok(tidal("drain", "a", env=env))
    assert json.loads(ok(tidal("undrain", "a", "--json", env=env)))["state"] == "live"
    clean_error(tidal("drain", "nope", env=env), 4, "node nope is not registered")


@pytest.mark.slow  # 17 s under load: a job run by an agent
def test_submit_exits_1_when_the_command_fails_and_status_shows_why(
    coordinator: Coordinator, procs: ProcessGroupRegistry, etcd_server: EtcdServer,
    etcd_root: str, tmp_path: Path,
) -> None:
    agents = AgentCluster(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                          workdir=tmp_path / "agents", procs=procs)
    agents.workdir.mkdir()
    agents.start_agent("a")
    env = coordinator.env()
    wait_for(lambda: coordinator.get("/v1/nodes"), timeout=30, what="agent a registered")

    result = tidal("submit", "--name", "fails", "--max-restarts", "0", "--",
                   sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)",
                   env=env, timeout=90)
    assert result.returncode == 1, f"{result}\n{agents.log_tails()}"
    assert "Traceback" not in result.stderr.replace("traceback or stderr", "")
    job = re.search(r"^submitted job (\S+) ", result.stdout, re.M).group(1)  # type: ignore[union-attr]
    assert f"job {job} FAILED" in result.stdout
    assert "rank 0 failed with exit code 3" in result.stderr
    assert "boom" in result.stderr

    view = json.loads(ok(tidal("status", job, "--json", env=env)))
    assert (view["phase"], view["exit_reason"], view["error"]["exit_code"]) == (
        "FAILED", "worker_failed", 3)
    status = ok(tidal("status", job, env=env))
    assert "error: rank 0 failed with exit code 3" in status
    assert tidal("status", job, "--watch", "--json", env=env).returncode == 1


def test_submit_f_runs_a_job_file_with_flags_and_a_command_overriding_it(
    coordinator: Coordinator, procs: ProcessGroupRegistry, etcd_server: EtcdServer,
    etcd_root: str, tmp_path: Path,
) -> None:
    agents = AgentCluster(etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root,
                          workdir=tmp_path / "agents", procs=procs)
    agents.workdir.mkdir()
    agents.start_agent("a")
    env = coordinator.env()
    wait_for(lambda: coordinator.get("/v1/nodes"), timeout=30, what="agent a registered")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "name: from-file\n"
        "command: [python, -c, 'import sys; sys.exit(9)']  # replaced after --\n"
        "max_restarts: 5\n"
        "priority: 7\n"
        "env:\n"
        "  GREETING: 42\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("command: [true]\ngpus: 1\n")
    clean_error(tidal("submit", "-f", str(bad), env=env), 2, f"{bad}:2: unknown key 'gpus'")

    result = tidal("submit", "-f", str(job_file), "--max-restarts", "0", "--",
                   sys.executable, "-c", "import os; print('greeting', os.environ['GREETING'])",
                   env=env, timeout=90)
    assert result.returncode == 0, f"{result}\n{agents.log_tails()}"
    assert "Traceback" not in result.stderr
    job = re.search(r"^submitted job (from-file-\S+) ", result.stdout, re.M).group(1)  # type: ignore[union-attr]
    assert f"job {job} SUCCEEDED" in result.stdout
    spec = json.loads(ok(tidal("status", job, "--json", env=env)))["spec"]
    assert (spec["max_restarts"], spec["priority"]) == (0, 7)
    assert spec["command"][0] == sys.executable


def test_resolve_target_takes_flags_then_environment_then_the_cluster_file(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    token_file = tmp_path / "token"
    token_file.write_text("from-the-cluster-file\n")
    state.mkdir()
    (state / "cluster.json").write_text(json.dumps(
        {"url": "http://127.0.0.1:9/", "token_file": str(token_file), "agents": []}))

    from_file = resolve_target(None, None, state, environ={})
    assert (from_file.url, from_file.token) == ("http://127.0.0.1:9", "from-the-cluster-file")
    env = {"TIDAL_URL": "http://env:1", "TIDAL_TOKEN": "env-token"}
    assert resolve_target(None, None, state, environ=env).token == "env-token"
    flagged = resolve_target("https://flag:2", "flag-token", state, environ=env)
    assert (flagged.url, flagged.token, flagged.url_source) == (
        "https://flag:2", "flag-token", "--url")
    # A local cluster's token never goes to another server.
    assert resolve_target("http://elsewhere:3", None, state, environ={}).token is None
    assert resolve_target(None, None, None, environ={"TIDAL_HOME": str(state)}).cluster
    with pytest.raises(TargetError, match="no tidal coordinator configured"):
        resolve_target(None, None, tmp_path / "empty", environ={})
    (state / "cluster.json").write_text("{not json")
    with pytest.raises(TargetError, match="is not valid"):
        resolve_target(None, None, state, environ={})
    assert resolve_target("http://flag:2", None, state, environ={}).cluster is None


def test_submit_zygote_preload_passes_modules_through_and_a_bad_name_is_refused(
    coordinator: Coordinator,
) -> None:
    env = coordinator.env()
    job = ok(tidal("submit", "--no-wait", "--zygote-preload", "json",
                   "--zygote-preload", "email.mime, collections", "--",
                   sys.executable, "-c", "pass", env=env)).strip()
    assert JOB_ID_RE.match(job), job
    spec = coordinator.get(f"/v1/jobs/{job}")["spec"]
    assert spec["zygote_preload"] == ["json", "email.mime", "collections"]
    clean_error(tidal("submit", "--no-wait", "--zygote-preload", "json,x;rm -rf /", "--",
                      sys.executable, "-c", "pass", env=env),
                2, "zygote_preload[1] ('x;rm -rf /') is not a dotted Python module name")
    ok(tidal("cancel", job, env=env))
