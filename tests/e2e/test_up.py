"""`tidal up` as a user runs it, and `make demo` end to end.

`tidal up` runs as a real process: it must describe what it started in
cluster.json, serve an authenticated API with every node registered, run its
etcd with authentication on (a write without credentials is refused, jobs
still run), bind the agents' metrics to loopback, refuse a second cluster on
the same state directory, and on SIGTERM stop everything it started and exit
0. It supervises its children: a coordinator killed with SIGKILL while a job
trains is replaced on the same URL and the job's step keeps increasing; an
agent killed with SIGKILL comes back and its node registers again. The demo
(slow) must show the job at world sizes 3, 2, 3, 2 and leave nothing running.
"""

from __future__ import annotations

import contextlib
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

from rendezvous.errors import EtcdAuthError
from rendezvous.etcd import EtcdConfig, create_client
from tests.support.processes import ProcessGroupRegistry, group_members
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"
CLUSTER_FIELDS = {
    "url", "token_file", "etcd_endpoint", "etcd_root", "etcd_password_files", "state_dir",
    "coordinator_pid", "etcd_pid", "agents",
}
AGENT_FIELDS = {"node_id", "pid", "run_dir", "metrics_port"}
ETCD_USERS = {"root", "tidal-coordinator", "tidal-agent"}
NO_SECRET = """
import os, sys
leaked = "TIDAL_ETCD_PASSWORD" in os.environ
leaked |= b"TIDAL_ETCD_PASSWORD=" in open("/proc/self/environ", "rb").read()
sys.exit("the etcd password reached the worker" if leaked else 0)
"""
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


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


def _listen_addresses(pid: int, port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) where ``pid`` listens on ``port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port_hex, 16) == port and fields[9] in inodes:
                found.add(address)
    return found


def _start_up(state: Path, log_path: Path, procs: ProcessGroupRegistry, agents: int
              ) -> tuple[subprocess.Popen[bytes], Any]:
    up = procs.spawn(
        [sys.executable, "-m", "service.cli", "up", "--agents", str(agents),
         "--state-dir", str(state)],
        log_path=log_path, env=_env(), cwd=REPO,
    )
    cluster = wait_for(lambda: _read_cluster_file(state / "cluster.json", up, log_path),
                       timeout=60, what="cluster.json")
    return up, cluster


def _stop_up(up: subprocess.Popen[bytes], log_path: Path) -> None:
    up.send_signal(signal.SIGTERM)
    try:
        assert up.wait(timeout=45) == 0, _log(log_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tidal up did not exit within 45 s of SIGTERM:\n{_log(log_path)}")


def _etcd_config(cluster: Any, user: str | None) -> EtcdConfig:
    password = (Path(cluster["etcd_password_files"][user]).read_text().strip()
                if user else None)
    return EtcdConfig(endpoints=[cluster["etcd_endpoint"]], root=cluster["etcd_root"],
                      timeout_s=5, user=user, password=password)  # type: ignore[arg-type]


@pytest.mark.slow  # 45 s under load: tidal up's whole cluster
@pytest.mark.timeout(150)
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
    # etcd's credentials: one file per user, readable by this user only.
    password_files = {user: Path(path) for user, path in cluster["etcd_password_files"].items()}
    assert set(password_files) == ETCD_USERS
    assert stat.S_IMODE((state / "etcd-auth").stat().st_mode) == 0o700
    for path in password_files.values():
        assert path.parent == state.resolve() / "etcd-auth"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert len(path.read_text().strip()) >= 32

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
        # On loopback only (0100007F is 127.0.0.1 in /proc/net/tcp), not on every interface.
        assert _listen_addresses(agent["pid"], agent["metrics_port"]) == {"0100007F"}

    # etcd refuses a write without credentials: nobody but the coordinator assigns
    # work (the issue's `etcdctl put /tidal/assignments/node-2/x ...`).
    forged = f"{cluster['etcd_root']}/assignments/node-2/x"
    with create_client(_etcd_config(cluster, None)) as anonymous:
        with pytest.raises(EtcdAuthError):
            anonymous.put(forged, b'{"job_id": "x", "command": ["touch", "/tmp/pwned"]}')
        with pytest.raises(EtcdAuthError):
            anonymous.get(f"{cluster['etcd_root']}/jobs/x")
    with create_client(_etcd_config(cluster, "tidal-agent")) as agent_user, \
            pytest.raises(EtcdAuthError):
        agent_user.put(forged, b"{}")
    with create_client(_etcd_config(cluster, "root")) as root:
        assert root.get(forged) is None

    # The agents and the coordinator read their password from a file: it is in
    # none of their environments (nor, so, in their workers').
    for pid in (cluster["coordinator_pid"], *(a["pid"] for a in cluster["agents"])):
        assert b"TIDAL_ETCD_PASSWORD" not in Path(f"/proc/{pid}/environ").read_bytes()

    # ... and jobs still run: scheduled as tidal-coordinator, run as tidal-agent;
    # the job's worker (forked by the runner's zygote) holds no etcd password.
    with httpx.Client(base_url=url, timeout=5,
                      headers={"Authorization": f"Bearer {token}"}) as api:
        created = api.post("/v1/jobs", json={"name": "hello",
                                             "command": [sys.executable, "-c", NO_SECRET]})
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]

        def finished() -> str | None:
            phase = str(api.get(f"/v1/jobs/{job_id}").json()["phase"])
            return phase if phase in TERMINAL else None

        assert wait_for(finished, timeout=60, what=f"job {job_id} to finish") == "SUCCEEDED"

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


@pytest.mark.slow  # 60 s and more under load: tidal up, a job training through two kills
@pytest.mark.timeout(300)
def test_up_restarts_a_killed_coordinator_and_agent_while_a_job_keeps_training(
    tmp_path: Path, procs: ProcessGroupRegistry
):
    state = tmp_path / "state"
    log_path = tmp_path / "up.log"
    up, cluster = _start_up(state, log_path, procs, agents=2)
    url = cluster["url"]
    token = Path(cluster["token_file"]).read_text().strip()
    api = httpx.Client(base_url=url, timeout=5, headers={"Authorization": f"Bearer {token}"})
    try:
        spec = {
            "name": "trains-on",
            "command": [sys.executable, str(MLP), "--total-steps", "1000000",
                        "--every-steps", "5", "--step-seconds", "0.2"],
            "working_dir": ".", "checkpoint_dir": "trains-on",
            "env": {"OMP_NUM_THREADS": "1"},
            "min_nodes": 1, "max_nodes": 1,
        }
        created = api.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]

        def job() -> Any:
            return api.get(f"/v1/jobs/{job_id}").json()

        def step_at_least(n: int) -> Any:
            view = job()
            assert view["phase"] not in TERMINAL, view
            return view if (view["last_step"] or 0) >= n else None

        before = wait_for(lambda: step_at_least(3), timeout=120, what="the job's step 3")
        (runs_on,) = [n["node_id"] for n in before["nodes"]]

        # SIGKILL the coordinator: tidal up starts another on the same URL.
        old_coordinator = cluster["coordinator_pid"]
        os.kill(old_coordinator, signal.SIGKILL)

        def new_coordinator() -> Any:
            now = _read_cluster_file(state / "cluster.json", up, log_path)
            if now is None or now["coordinator_pid"] == old_coordinator:
                return None
            try:
                return now if httpx.get(f"{url}/readyz", timeout=2).status_code == 200 else None
            except httpx.HTTPError:
                return None

        after = wait_for(new_coordinator, timeout=60, what="a new coordinator ready at " + url)
        assert after["url"] == url
        # The job trained on, from where it was: its step grows past the one seen
        # before the kill, its workers were never restarted, it never left RUNNING.
        later = wait_for(lambda: step_at_least(before["last_step"] + 5), timeout=60,
                         what="the job's step to keep increasing")
        assert later["restart_count"] == before["restart_count"], later
        assert later["phase"] == "RUNNING", later

        # SIGKILL the other agent: it comes back and its node registers again,
        # on a lease of its own (the dead one's expired).
        idle = next(a for a in after["agents"] if a["node_id"] != runs_on)
        with create_client(_etcd_config(after, "root")) as root:
            node_key = root.keys.node(idle["node_id"])
            old_record = root.get(node_key)
            assert old_record is not None
            os.kill(idle["pid"], signal.SIGKILL)

            def back() -> Any:
                now = _read_cluster_file(state / "cluster.json", up, log_path)
                entry = next(a for a in now["agents"] if a["node_id"] == idle["node_id"])
                if entry["pid"] == idle["pid"] or entry["metrics_port"] is None:
                    return None
                record = root.get(node_key)
                return entry if record is not None and record.lease != old_record.lease else None

            entry = wait_for(back, timeout=60, what=f"{idle['node_id']} to come back")
        assert entry["metrics_port"] == idle["metrics_port"]  # Prometheus's target stays valid
        nodes = {n["node_id"] for n in api.get("/v1/nodes").json()}
        assert {runs_on, idle["node_id"]} <= nodes
        assert (job()["last_step"] or 0) >= later["last_step"]
        output = _log(log_path)
        assert f"coordinator (pid {old_coordinator}) exited with code -9" in output
        assert f"{idle['node_id']} (pid {idle['pid']}) exited with code -9" in output
    finally:
        api.close()
    _stop_up(up, log_path)
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


@pytest.mark.slow  # 60 s under load: tidal up's whole cluster
@pytest.mark.timeout(150)
def test_a_sigkilled_tidal_up_takes_etcd_the_coordinator_and_the_agents_with_it(
    tmp_path: Path, procs: ProcessGroupRegistry
):
    """Each child has a session of its own (so that `tidal up` can stop it as a whole),
    which puts it out of reach of a signal to `tidal up`'s group: the kernel's
    parent-death signal is what stops them when `tidal up` cannot."""
    state = tmp_path / "state"
    log_path = tmp_path / "up.log"
    up, cluster = _start_up(state, log_path, procs, agents=1)
    children = {"etcd": cluster["etcd_pid"], "coordinator": cluster["coordinator_pid"],
                **{a["node_id"]: a["pid"] for a in cluster["agents"]}}
    assert all(isinstance(pid, int) for pid in children.values()), children
    up.send_signal(signal.SIGKILL)  # tidal up alone, not its group: nothing gets to stop them
    up.wait(timeout=10)

    def alive() -> dict[str, int]:
        running = {}
        for name, pid in children.items():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # gone
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                running[name] = pid
        return running

    try:
        wait_for(lambda: not alive(), timeout=60,
                 what="etcd, the coordinator and the agent to exit after tidal up's death")
        wait_for(lambda: not _processes_mentioning(str(state)), timeout=30,
                 what="no process of this cluster left (runners, zygotes)")
    finally:
        for pid in alive().values():  # on failure, stop what tidal up left (each its group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
