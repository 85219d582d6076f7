"""`tidal up` as a user runs it, and `make demo` end to end.

`tidal up` runs as a real process: it must describe what it started in
cluster.json, serve an authenticated API with every node registered, refuse a
second cluster on the same state directory, and on SIGTERM stop everything it
started and exit 0. The demo (slow) must show the job at world sizes 3, 2, 3, 2
and leave nothing running.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import ProcessGroupRegistry, group_members
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
CLUSTER_FIELDS = {
    "url", "token_file", "etcd_endpoint", "etcd_root", "state_dir",
    "coordinator_pid", "etcd_pid", "agents",
}
AGENT_FIELDS = {"node_id", "pid", "run_dir", "metrics_port"}


def _env() -> dict[str, str]:
    """This environment without TIDAL_* settings (a TIDAL_TOKEN or TIDAL_HOME of the caller)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}


def _processes_mentioning(text: str) -> list[str]:
    """Live processes (not zombies) whose command line contains ``text``."""
    needle = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in cmdline:
            words = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {words}")
    return found


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def _read_cluster_file(path: Path, up: subprocess.Popen[bytes], log_path: Path) -> Any:
    if up.poll() is not None:
        pytest.fail(f"tidal up exited with {up.returncode}:\n{_log(log_path)}")
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.timeout(90)
def test_up_serves_the_api_with_its_nodes_and_stops_everything_on_sigterm(
    tmp_path: Path, procs: ProcessGroupRegistry
):
    state = tmp_path / "state"
    log_path = tmp_path / "up.log"
    up = procs.spawn(
        [sys.executable, "-m", "service.cli", "up", "--agents", "2", "--state-dir", str(state)],
        log_path=log_path, env=_env(), cwd=REPO,
    )
    cluster_file = state / "cluster.json"
    cluster = wait_for(lambda: _read_cluster_file(cluster_file, up, log_path), timeout=45,
                       what="cluster.json")

    assert set(cluster) == CLUSTER_FIELDS
    assert cluster["url"].startswith("http://127.0.0.1:")
    assert cluster["token_file"] == str(state.resolve() / "token")
    assert cluster["state_dir"] == str(state.resolve())
    assert cluster["etcd_root"] == "/tidal"
    assert cluster["etcd_endpoint"].startswith("127.0.0.1:")
    assert isinstance(cluster["coordinator_pid"], int) and isinstance(cluster["etcd_pid"], int)
    assert [a["node_id"] for a in cluster["agents"]] == ["node-1", "node-2"]
    for agent in cluster["agents"]:
        assert set(agent) == AGENT_FIELDS
        assert agent["run_dir"] == str(state.resolve() / "run" / agent["node_id"])
        assert isinstance(agent["pid"], int) and isinstance(agent["metrics_port"], int)
    token_file = Path(cluster["token_file"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32

    url = cluster["url"]
    with httpx.Client(base_url=url, timeout=5) as http:
        assert http.get("/readyz").status_code == 200
        nodes = http.get("/v1/nodes", headers={"Authorization": f"Bearer {token}"})
        assert nodes.status_code == 200, nodes.text
        assert {"node-1", "node-2"} <= {n["node_id"] for n in nodes.json()}
        assert http.get("/v1/nodes").status_code == 401
        assert http.get("/v1/nodes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    for agent in cluster["agents"]:
        metrics = httpx.get(f"http://127.0.0.1:{agent['metrics_port']}/metrics", timeout=5)
        assert metrics.status_code == 200

    # A second cluster on the same state directory is refused, and leaves the first alone.
    second = subprocess.run(
        [sys.executable, "-m", "service.cli", "up", "--agents", "1", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60, env=_env(), cwd=REPO, check=False,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert "already runs" in second.stderr
    assert json.loads(cluster_file.read_text()) == cluster
    assert token_file.read_text().strip() == token

    pids = [cluster["coordinator_pid"], cluster["etcd_pid"], *(a["pid"] for a in cluster["agents"])]
    up.send_signal(signal.SIGTERM)
    try:
        assert up.wait(timeout=30) == 0, _log(log_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tidal up did not exit within 30 s of SIGTERM:\n{_log(log_path)}")
    assert not cluster_file.exists()
    # Each child led its own process group: nothing of any group survives.
    for pid in pids:
        wait_for(lambda pid=pid: not group_members(pid), timeout=5,
                 what=f"process group {pid} to be empty")
    assert _processes_mentioning(str(state)) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_shows_the_job_shrink_grow_and_shrink_and_leaves_nothing_running(
    tmp_path: Path, procs: ProcessGroupRegistry
):
    state = tmp_path / "demo-state"
    log_path = tmp_path / "demo.log"
    demo = procs.spawn(
        [sys.executable, "-m", "examples.demo", "--state-dir", str(state)],
        log_path=log_path, env=_env(), cwd=REPO,
    )
    try:
        code = demo.wait(timeout=540)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the demo did not finish within 540 s:\n{_log(log_path)}")
    output = _log(log_path)
    assert code == 0, output

    sizes_line = next(
        (line for line in output.splitlines() if line.startswith("world sizes: ")), None
    )
    assert sizes_line is not None, output
    sizes = [int(s) for s in sizes_line.removeprefix("world sizes: ").split(" -> ")]
    expected = iter([3, 2, 3, 2])
    want = next(expected)
    for size in sizes:  # 3, 2, 3, 2 in this order, possibly with other sizes between
        if size == want:
            want = next(expected, None)
            if want is None:
                break
    assert want is None, f"world sizes {sizes} do not pass through 3, 2, 3, 2\n{output}"
    for event in ("kill node-", "add node-", "scale down"):
        assert any(line.strip().startswith(event) for line in output.splitlines()), (
            f"no recovery line for {event!r}\n{output}"
        )
    assert "final loss" in output
    assert "never ran at size" not in output
    assert _processes_mentioning(str(state)) == []
