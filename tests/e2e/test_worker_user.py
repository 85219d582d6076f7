"""Workers as another user (issue 12, part 3): an agent that runs as root runs its
jobs' workers as ``--worker-user``, which cannot read the agent's secrets."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment, JobNodeState
from tests.support.agents import AgentCluster, assign, statuses
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

WORKER_USER = "nobody"

# Run by a Python that the worker user may execute (the test's own may sit
# under /root). It reports who it is and what it can reach, as JSON.
PROBE = """
import json, os, sys
def readable(path):
    try:
        open(path, "rb").read(1)
        return True
    except OSError:
        return False
progress = os.environ["TIDAL_PROGRESS_DIR"]
job_dir = os.path.dirname(progress)
wrote = False
try:
    with open(os.path.join(progress, "probe.txt"), "w") as f:
        f.write("x")
    wrote = True
except OSError:
    pass
try:
    open(os.environ["TORCHELASTIC_ERROR_FILE"], "a").close()
    error_file = True
except (OSError, KeyError):
    error_file = False
print(json.dumps({
    "ids": [os.getuid(), os.geteuid(), os.getgid()], "groups": os.getgroups(),
    "home": os.environ.get("HOME"), "token": readable(sys.argv[1]),
    "spec": readable(os.path.join(job_dir, "runner-spec.json")),
    "runner_log": readable(os.path.join(job_dir, "runner.log")),
    "progress_written": wrote, "error_file": error_file,
    "password": "TIDAL_ETCD_PASSWORD" in os.environ,
}), flush=True)
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory anyone may enter (pytest's own are root's alone): the worker
    user must reach its progress directory, below the agent's run directory."""
    path = Path(tempfile.mkdtemp(prefix="tidal-worker-user-"))
    try:
        os.chmod(path, 0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory as `tidal up` keeps it: anyone may enter, the token is 0600."""
    path = Path(tempfile.mkdtemp(prefix="tidal-state-"))
    try:
        os.chmod(path, 0o755)
        token = path / "token"
        token.write_text("s3cret-token\n")
        os.chmod(token, 0o600)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _system_python() -> str:
    found = shutil.which("python3", path="/usr/bin:/bin")
    if found is None:
        pytest.skip("no system python3 that the worker user may run")
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run workers as another user")
def test_workers_run_as_the_worker_user_and_cannot_read_the_agents_secrets(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, etcd_client: EtcdClient,
    procs: ProcessGroupRegistry, state_dir: Path, open_dir: Path,
) -> None:
    user = pwd.getpwnam(WORKER_USER)
    python = _system_python()
    cluster = AgentCluster(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=open_dir, procs=procs
    )
    cluster.start_agent("a", extra=("--worker-user", WORKER_USER))
    assign(etcd_client, "a", Assignment(
        job_id="probe", command=[python, "-c", PROBE, str(state_dir / "token")],
        min_nodes=1, max_nodes=1, max_restarts=0, nproc_per_node=2,
    ))
    try:
        wait_for(lambda: (s := statuses(etcd_client, "probe").get("a")) is not None
                 and s.state == JobNodeState.SUCCEEDED,
                 timeout=120, what="the probe job succeeded on a")
    except Exception:
        print(cluster.log_tails())
        raise
    run_dir = open_dir / "a"
    logs = sorted(run_dir.rglob("stdout.log"))
    assert len(logs) == 2  # one per rank
    for log in logs:
        report = json.loads(log.read_text().strip().splitlines()[-1])
        assert report["ids"] == [user.pw_uid, user.pw_uid, user.pw_gid]
        assert set(report["groups"]) <= set(os.getgrouplist(WORKER_USER, user.pw_gid))
        assert report["home"] == user.pw_dir
        assert report["token"] is False  # the root-owned 0600 token
        assert report["spec"] is False and report["runner_log"] is False
        assert report["password"] is False
        # What it must write, it can: progress reports and torch's error file.
        assert report["progress_written"] is True and report["error_file"] is True
        assert log.stat().st_uid == 0 and log.stat().st_mode & 0o777 == 0o600
    # The agent's run directory: its own, the worker user's group may pass through.
    info = run_dir.stat()
    assert info.st_mode & 0o777 == 0o710 and info.st_gid == user.pw_gid
    # The runner, which holds the etcd credentials, stayed root: it reported the status.
    assert statuses(etcd_client, "probe")["a"].state == JobNodeState.SUCCEEDED


def test_a_worker_user_is_refused_where_it_cannot_be_used(tmp_path: Path) -> None:
    """Settings errors name the user and exit 2 (the agent never starts)."""
    base = [sys.executable, "-m", "service.cli", "agent", "--etcd", "127.0.0.1:1",
            "--run-dir", str(tmp_path / "run")]
    missing = subprocess.run([*base, "--worker-user", "no-such-user-tidal"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 2
    assert "worker_user (no-such-user-tidal): there is no such user" in missing.stderr
    root = subprocess.run([*base, "--worker-user", "root"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert root.returncode == 2
    assert "worker_user (root) is root" in root.stderr
