"""The coordinator's HTTP API against a real etcd and a real uvicorn process.

Nodes are registered straight into etcd (real leased records, no agents), so
the scheduler assigns jobs without running them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.records import Assignment
from rendezvous.registry import NodeInfo, NodeRegistration, NodeRegistry
from tests.support.coordinator import TOKEN, CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

SECRET = "s3cr3t-value-that-must-never-leak"


@pytest.fixture
def coordinator(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> CoordinatorProcess:
    return CoordinatorProcess(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs
    ).start()


@pytest.fixture
def api(coordinator: CoordinatorProcess) -> Iterator[httpx.Client]:
    with coordinator.client() as client:
        yield client


@pytest.fixture
def register(etcd_client: EtcdClient) -> Iterator[object]:
    """register(node_id, slots=1, labels={}) puts a live node record in etcd."""
    registrations: list[NodeRegistration] = []

    def add(node_id: str, *, slots: int = 1, labels: dict[str, str] | None = None) -> None:
        info = NodeInfo(node_id=node_id, host="h", address="127.0.0.1", slots=slots,
                        labels=labels or {})
        registrations.append(NodeRegistry(etcd_client).register(info, ttl_s=3))

    yield add
    for reg in registrations:
        reg.close()


def _submit(api: httpx.Client, **overrides: object) -> dict[str, object]:
    response = api.post("/v1/jobs", json=job_spec(**overrides))
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def _phase(api: httpx.Client, job_id: object) -> str:
    return str(api.get(f"/v1/jobs/{job_id}").json()["phase"])


# authentication ------------------------------------------------------------------------

ROUTES = [
    ("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/jobs/j-1"),
    ("PATCH", "/v1/jobs/j-1"), ("POST", "/v1/jobs/j-1/cancel"), ("GET", "/v1/jobs/j-1/events"),
    ("GET", "/v1/nodes"), ("POST", "/v1/nodes/n-1/drain"), ("DELETE", "/v1/nodes/n-1/drain"),
]


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", "x"])
def test_every_v1_route_refuses_a_missing_or_wrong_token_and_changes_nothing(
    coordinator: CoordinatorProcess, etcd_client: EtcdClient, token: str | None
):
    with coordinator.client(token=token) as client:
        for method, path in ROUTES:
            body = job_spec() if path == "/v1/jobs" and method == "POST" else None
            response = client.request(method, path, json=body)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"] == "missing or wrong bearer token"
            assert response.headers["www-authenticate"] == "Bearer"
    assert etcd_client.get_prefix(etcd_client.keys.jobs_prefix())[0] == []


def test_health_readiness_and_metrics_need_no_token(coordinator: CoordinatorProcess):
    with coordinator.client(token=None) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=15,
                 what="/readyz with an elected leader")
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert "tidal_coordinator_leader 1.0" in metrics.text


def test_the_openapi_document_is_served(coordinator: CoordinatorProcess):
    with coordinator.client(token=None) as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/events", "/v1/nodes", "/v1/nodes/{node_id}/drain",
            "/healthz", "/readyz", "/metrics"} <= set(paths)


# submit and validation -----------------------------------------------------------------


def test_a_submitted_job_is_pending_until_a_node_exists_then_scheduled(
    api: httpx.Client, register: object, etcd_client: EtcdClient
):
    job = _submit(api, name="train", min_nodes=1, max_nodes=2)
    assert job["phase"] == "PENDING"
    assert str(job["job_id"]).startswith("train-")
    register("n-1")  # type: ignore[operator]
    wait_for(lambda: _phase(api, job["job_id"]) == "RUNNING", timeout=15, what="RUNNING")
    kv = etcd_client.get(etcd_client.keys.assignment("n-1", str(job["job_id"])))
    assert kv is not None
    assignment = Assignment.model_validate_json(kv.value)
    assert assignment.min_nodes == 1 and assignment.max_nodes == 2
    view = api.get(f"/v1/jobs/{job['job_id']}").json()
    assert [n["node_id"] for n in view["nodes"]] == ["n-1"]
    scheduled = [c for c in view["conditions"] if c["type"] == "Scheduled"]
    assert scheduled and scheduled[0]["status"] is True


def test_a_shell_string_is_one_literal_argument_never_run_through_a_shell(
    api: httpx.Client, register: object, etcd_client: EtcdClient
):
    register("n-1")  # type: ignore[operator]
    job = _submit(api, command=["echo", "x; rm -rf /"])
    key = etcd_client.keys.assignment("n-1", str(job["job_id"]))
    kv = wait_for(lambda: etcd_client.get(key), timeout=15, what="the assignment")
    assert Assignment.model_validate_json(kv.value).command == ["echo", "x; rm -rf /"]


def test_a_jobs_zygote_preload_list_reaches_its_assignment_and_a_bad_name_is_a_422(
    api: httpx.Client, register: object, etcd_client: EtcdClient
):
    response = api.post("/v1/jobs", json=job_spec(zygote_preload=["transformers", "my-lib"]))
    assert response.status_code == 422, response.text
    assert "zygote_preload[1] ('my-lib') is not a dotted Python module name" in (
        response.json()["error"]), response.text
    register("n-1")  # type: ignore[operator]
    job = _submit(api, zygote_preload=["transformers", "lightning.pytorch"])
    assert job["spec"]["zygote_preload"] == ["transformers", "lightning.pytorch"]  # type: ignore[index]
    key = etcd_client.keys.assignment("n-1", str(job["job_id"]))
    kv = wait_for(lambda: etcd_client.get(key), timeout=15, what="the assignment")
    assert Assignment.model_validate_json(kv.value).zygote_preload == [
        "transformers", "lightning.pytorch"]


def test_secrets_in_the_environment_are_never_echoed(
    coordinator: CoordinatorProcess, api: httpx.Client, register: object
):
    register("n-1")  # type: ignore[operator]
    job = _submit(api, env={"API_KEY": SECRET})
    assert job["spec"]["env_names"] == ["API_KEY"]  # type: ignore[index]
    wait_for(lambda: _phase(api, job["job_id"]) == "RUNNING", timeout=15, what="RUNNING")
    bad = api.post("/v1/jobs", json=job_spec(env={"BAD NAME": SECRET}))
    assert bad.status_code == 422
    seen = [
        api.get(f"/v1/jobs/{job['job_id']}").text,
        api.get("/v1/jobs").text,
        api.get(f"/v1/jobs/{job['job_id']}/events").text,
        bad.text,
        httpx.get(f"{coordinator.url}/metrics").text,
        coordinator.log_path.read_text(),
    ]
    assert not [text for text in seen if SECRET in text]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes (3) is greater than max_nodes (2)"),
        ({"min_nodes": 0}, "min_nodes"),
        ({"max_nodes": -1}, "max_nodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"command": "python train.py"}, "command"),
        ({"command": []}, "command"),
        ({"command": ["x"] * 300}, "command"),
        ({"command": ["a\0b"]}, "command"),
        ({"name": "../etc"}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": ""}, "name"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"env": {"RANK": "3"}}, "env"),
        ({"env": {"TIDAL_JOB_ID": "x"}}, "env"),
        ({"working_dir": "../outside"}, "working_dir"),
        ({"working_dir": "/etc"}, "working_dir"),
        ({"checkpoint_dir": "a/../../b"}, "checkpoint_dir"),
        ({"checkpoint_dir": "~root"}, "checkpoint_dir"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"priority": 10**9}, "priority"),
        ({"node_selector": {"gpu": "a b"}}, "node_selector"),
        ({"resize_policy": {"lr_rule": "cubic"}}, "resize_policy"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_an_invalid_spec_is_a_422_naming_the_field(
    api: httpx.Client, etcd_client: EtcdClient, overrides: dict[str, object], field: str
):
    response = api.post("/v1/jobs", json=job_spec(**overrides))
    assert response.status_code == 422, response.text
    assert field in response.json()["error"], response.text
    assert etcd_client.get_prefix(etcd_client.keys.jobs_prefix())[0] == []


def test_a_working_dir_that_escapes_its_root_through_a_symlink_is_refused(
    coordinator: CoordinatorProcess, api: httpx.Client
):
    os.symlink("/etc", coordinator.workdir_root / "escape")
    (coordinator.workdir_root / "inside").mkdir()
    response = api.post("/v1/jobs", json=job_spec(working_dir="escape/x"))
    assert response.status_code == 422
    assert "working_dir" in response.json()["error"]
    accepted = _submit(api, working_dir="inside")
    assert accepted["spec"]["working_dir"] == "inside"  # type: ignore[index]


def test_malformed_bodies_are_refused_without_a_server_error(api: httpx.Client):
    headers = {"content-type": "application/json"}
    assert api.post("/v1/jobs", content=b"{not json", headers=headers).status_code == 422
    assert api.post("/v1/jobs", content=b"[]", headers=headers).status_code == 422
    huge = b'{"name": "x", "command": ["' + b"a" * (10 * 1024 * 1024) + b'"]}'
    response = api.post("/v1/jobs", content=huge, headers=headers)
    assert response.status_code == 413
    assert "larger than" in response.json()["error"]


def test_unknown_and_malformed_job_ids(api: httpx.Client):
    assert api.get("/v1/jobs/no-such-job").status_code == 404
    assert "does not exist" in api.get("/v1/jobs/no-such-job").json()["error"]
    assert api.get("/v1/jobs/no-such-job/events").status_code == 404
    assert api.post("/v1/jobs/no-such-job/cancel").status_code == 404
    assert api.patch("/v1/jobs/no-such-job", json={"max_nodes": 2}).status_code == 404
    for bad in ("..", ".hidden", "a" * 64, "x%00y"):
        assert api.get(f"/v1/jobs/{bad}").status_code in (404, 422), bad


# list ----------------------------------------------------------------------------------


def test_jobs_are_listed_oldest_first_in_pages_and_filtered_by_phase(api: httpx.Client):
    ids = [_submit(api, name=f"j{i}")["job_id"] for i in range(5)]
    seen: list[object] = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = api.get("/v1/jobs", params=params).json()
        seen += [j["job_id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids
    api.post(f"/v1/jobs/{ids[0]}/cancel")
    wait_for(lambda: _phase(api, ids[0]) == "CANCELLED", timeout=15, what="CANCELLED")
    cancelled = api.get("/v1/jobs", params={"phase": "CANCELLED"}).json()["jobs"]
    assert [j["job_id"] for j in cancelled] == [ids[0]]
    assert api.get("/v1/jobs", params={"phase": "NOPE"}).status_code == 422
    assert api.get("/v1/jobs", params={"cursor": "!!!"}).status_code == 422
    assert api.get("/v1/jobs", params={"limit": 0}).status_code == 422


# scale, cancel, events -----------------------------------------------------------------


def test_scaling_changes_the_bounds_and_records_an_event(api: httpx.Client):
    job = _submit(api, min_nodes=1, max_nodes=2)
    response = api.patch(f"/v1/jobs/{job['job_id']}", json={"max_nodes": 4})
    assert response.status_code == 200, response.text
    assert response.json()["spec"]["max_nodes"] == 4
    bad = api.patch(f"/v1/jobs/{job['job_id']}", json={"min_nodes": 5})
    assert bad.status_code == 422
    assert "min_nodes (5) is greater than max_nodes (4)" in bad.json()["error"]
    assert api.patch(f"/v1/jobs/{job['job_id']}", json={}).status_code == 422
    assert api.patch(f"/v1/jobs/{job['job_id']}", json={"max_nodes": 0}).status_code == 422
    events = api.get(f"/v1/jobs/{job['job_id']}/events").json()["events"]
    assert [e["reason"] for e in events][:1] == ["submitted"]
    assert "scaled_by_user" in [e["reason"] for e in events]
    assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})


def test_a_cancelled_job_cannot_be_scaled_or_cancelled_again(api: httpx.Client):
    job = _submit(api)
    response = api.post(f"/v1/jobs/{job['job_id']}/cancel")
    assert response.status_code == 202
    assert response.json()["cancel_requested"] is True
    wait_for(lambda: _phase(api, job["job_id"]) == "CANCELLED", timeout=15, what="CANCELLED")
    view = api.get(f"/v1/jobs/{job['job_id']}").json()
    assert view["exit_reason"] == "cancelled" and view["finished_at"] is not None
    assert api.patch(f"/v1/jobs/{job['job_id']}", json={"max_nodes": 2}).status_code == 409
    again = api.post(f"/v1/jobs/{job['job_id']}/cancel")
    assert again.status_code == 409
    assert "CANCELLED" in again.json()["error"]


# nodes ---------------------------------------------------------------------------------


def test_nodes_are_listed_and_a_drained_node_loses_its_jobs(
    api: httpx.Client, register: object, etcd_client: EtcdClient
):
    register("n-1", slots=2, labels={"zone": "a"})  # type: ignore[operator]
    register("n-2")  # type: ignore[operator]
    wait_for(lambda: len(api.get("/v1/nodes").json()) == 2, timeout=10, what="two nodes")
    job = _submit(api, min_nodes=1, max_nodes=1, node_selector={"zone": "a"})
    wait_for(lambda: _phase(api, job["job_id"]) == "RUNNING", timeout=15, what="RUNNING")
    nodes = {n["node_id"]: n for n in api.get("/v1/nodes").json()}
    assert nodes["n-1"]["jobs"] == [job["job_id"]] and nodes["n-1"]["slots_used"] == 1
    assert nodes["n-1"]["labels"] == {"zone": "a"} and nodes["n-2"]["jobs"] == []

    drained = api.post("/v1/nodes/n-1/drain")
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    key = etcd_client.keys.assignment("n-1", str(job["job_id"]))
    wait_for(lambda: etcd_client.get(key) is None, timeout=15, what="the drained assignment gone")
    # The only node with zone=a drains: the job waits rather than run elsewhere.
    wait_for(lambda: _phase(api, job["job_id"]) == "PENDING", timeout=15, what="PENDING")
    reasons = [e["reason"] for e in api.get(f"/v1/jobs/{job['job_id']}/events").json()["events"]]
    assert "node_drained" in reasons

    assert api.delete("/v1/nodes/n-1/drain").json()["state"] == "live"
    wait_for(lambda: etcd_client.get(key) is not None, timeout=15, what="rescheduled on n-1")
    assert api.post("/v1/nodes/ghost/drain").status_code == 404


# etcd failures -------------------------------------------------------------------------


def test_an_unreachable_etcd_is_a_503_within_the_timeout_and_the_api_recovers(
    tmp_path: Path, fresh_etcd: EtcdServer, procs: ProcessGroupRegistry
):
    coordinator = CoordinatorProcess(
        etcd_endpoint=fresh_etcd.endpoint, etcd_root="/tidal", workdir=tmp_path, procs=procs
    ).start()
    with coordinator.client() as api:
        job = _submit(api)
        fresh_etcd.kill()
        response = api.get(f"/v1/jobs/{job['job_id']}", timeout=30)
        assert response.status_code == 503, response.text
        assert "etcd is unavailable" in response.json()["error"]
        assert api.get("/readyz", timeout=30).status_code == 503
        fresh_etcd.start()
        wait_for(lambda: api.get(f"/v1/jobs/{job['job_id']}").status_code == 200, timeout=30,
                 what="the API answering again after etcd came back")
        assert api.get(f"/v1/jobs/{job['job_id']}").json()["job_id"] == job["job_id"]


def test_request_metrics_are_labelled_by_route_template(
    coordinator: CoordinatorProcess, api: httpx.Client
):
    api.get("/v1/jobs/one-1")
    api.get("/v1/jobs/two-2")
    text = httpx.get(f"{coordinator.url}/metrics").text
    assert 'route="/v1/jobs/{job_id}"' in text
    assert "one-1" not in text and "two-2" not in text


def test_the_token_file_and_environment_configure_auth(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
):
    coordinator = CoordinatorProcess(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs,
    )
    assert coordinator.token_file.read_text() == TOKEN
    config = EtcdConfig(endpoints=[etcd_server.endpoint], root=etcd_root)
    with create_client(config) as client:
        assert client.get_prefix(client.keys.jobs_prefix())[0] == []
    # No token at all is refused unless --insecure-no-auth, which is loopback only.
    argv = [a for a in coordinator.argv if a not in ("--token-file", str(coordinator.token_file))]
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_TOKEN"}
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "no API token" in refused.stderr
    remote = subprocess.run([*argv, "--insecure-no-auth", "--host", "0.0.0.0"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert remote.returncode != 0 and "loopback only" in remote.stderr
