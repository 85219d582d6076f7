"""No job wedges scheduling, against a real etcd and a real coordinator process.

Issue 12: a job whose writes etcd refuses (a request too large, too many
operations in one transaction) must never stop the reconcile pass for the
others; a job of 300 nodes must place; passes that keep failing show in
/readyz and /metrics; assignments nobody wrote are deleted; the API answers
every error in its documented shape. Nodes are leased records put straight
into etcd (no agents), as the coordinator benchmark does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rendezvous.errors import EtcdNoSpaceError
from rendezvous.etcd import EtcdClient, EtcdConfig, Put, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.lease import LeaseKeeper
from rendezvous.records import Assignment, JobNodeState, JobNodeStatus
from rendezvous.registry import NodeInfo, NodeRegistration, NodeRegistry
from service.api.models import MAX_ENV_BYTES, JobRecord, JobSpec
from tests.support.coordinator import CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

# The issue's example: 125 values of 8,000 characters, a 1.0 MB body.
BIG_ENV = {f"VAR_{i}": "x" * 8000 for i in range(125)}


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


class Nodes:
    """Live node records in etcd, each on its own lease, closed at teardown."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.registrations: dict[str, NodeRegistration] = {}

    def add(self, *node_ids: str) -> None:
        for node_id in node_ids:
            info = NodeInfo(node_id=node_id, host="h", address="127.0.0.1", slots=1)
            self.registrations[node_id] = NodeRegistry(self.client).register(info, ttl_s=5)

    def remove(self, node_id: str) -> None:
        self.registrations.pop(node_id).close()

    def close(self) -> None:
        for reg in self.registrations.values():
            reg.close()


@pytest.fixture
def nodes(etcd_client: EtcdClient) -> Iterator[Nodes]:
    registered = Nodes(etcd_client)
    yield registered
    registered.close()


def _submit(api: httpx.Client, **overrides: object) -> str:
    response = api.post("/v1/jobs", json=job_spec(**overrides))
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _job(api: httpx.Client, job_id: str) -> dict[str, object]:
    response = api.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _placed(client: EtcdClient, job_id: str) -> dict[str, Assignment]:
    prefix = client.keys.assignments_prefix()
    kvs, _ = client.get_prefix(prefix)
    out = {}
    for kv in kvs:
        node_id, job = client.keys.parse_assignment(kv.key)
        if job == job_id:
            out[node_id] = Assignment.model_validate_json(kv.value)
    return out


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


# one job never stops the others ----------------------------------------------------------


def test_the_issues_example_is_refused_naming_the_limit_and_a_later_job_runs(
    api: httpx.Client, nodes: Nodes, etcd_client: EtcdClient
):
    nodes.add("n-1")
    body = job_spec(name="huge", env=BIG_ENV)
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert "env" in error and str(MAX_ENV_BYTES) in error, error
    assert "x" * 100 not in response.text  # the values are never echoed
    assert etcd_client.get_prefix(etcd_client.keys.jobs_prefix())[0] == []
    later = _submit(api, name="later")
    wait_for(lambda: _job(api, later)["phase"] == "RUNNING", timeout=20, what="later RUNNING")
    assert set(_placed(etcd_client, later)) == {"n-1"}


def test_a_stored_job_too_big_for_one_request_places_in_several_and_others_still_run(
    coordinator: CoordinatorProcess, api: httpx.Client, nodes: Nodes, etcd_client: EtcdClient
):
    """A 1.0 MB spec stored before the limits existed: each write fits; no pass fails."""
    spec = JobSpec(name="legacy", command=["python", "-c", "pass"], env=BIG_ENV,
                   min_nodes=2, max_nodes=2)
    record = JobRecord(job_id="legacy-00000001", spec=spec, next_event=1)
    etcd_client.put(etcd_client.keys.job(record.job_id), record.model_dump_json().encode())
    nodes.add("n-1", "n-2", "n-3")
    placed = wait_for(lambda: len(_placed(etcd_client, record.job_id)) == 2, timeout=30,
                      what=f"the big job on two nodes; log:\n{coordinator.log_tail()}")
    assert placed
    later = _submit(api, name="later")
    wait_for(lambda: _job(api, later)["phase"] == "RUNNING", timeout=20, what="later RUNNING")
    assert set(_placed(etcd_client, later)) == {"n-3"}
    assert _job(api, record.job_id)["phase"] == "RUNNING"
    assert re.search(rf"job {record.job_id}: change of \d+ operations written in [3-9] "
                     "transactions", coordinator.log_path.read_text())
    metrics = httpx.get(f"{coordinator.url}/metrics", timeout=5).text
    assert _metric(metrics, "tidal_coordinator_reconcile_failures_total") == 0
    assert _metric(metrics, "tidal_coordinator_job_write_failures_total") == 0


# Two ways etcd refuses one job's change: more operations than --max-txn-ops
# (10 assignments, the record and 2 events: 13 > 8), and a request over
# --max-request-bytes (2 assignments and the record of a 100 KB spec: 300 KB >
# 200 KB, while the API's own write of the record, 100 KB, fits).
REFUSALS = {
    "too-many-operations": (["--max-txn-ops", "8"], {"min_nodes": 10, "max_nodes": 10},
                            "too many operations"),
    "request-too-large": (["--max-request-bytes", str(200 * 1024)],
                          {"min_nodes": 2, "max_nodes": 2,
                           "env": {f"V{i}": "x" * 8000 for i in range(12)}},
                          "request is too large"),
}


@pytest.fixture(params=sorted(REFUSALS))
def strict_etcd(
    request: pytest.FixtureRequest, tmp_path: Path, durable_etcd_binary: Path
) -> Iterator[tuple[EtcdServer, dict[str, object], str]]:
    """A private etcd with a limit one job's change exceeds; the job and etcd's message."""
    flags, job, message = REFUSALS[request.param]
    server = EtcdServer(data_dir=tmp_path / "etcd-strict", binary=durable_etcd_binary,
                        extra_args=flags)
    server.start()
    try:
        yield server, job, message
    finally:
        server.cleanup()


def test_a_job_whose_write_etcd_refuses_fails_on_its_own_and_the_others_are_scheduled(
    tmp_path: Path, strict_etcd: tuple[EtcdServer, dict[str, object], str],
    procs: ProcessGroupRegistry,
):
    etcd, wide_spec, refusal = strict_etcd
    coordinator = CoordinatorProcess(
        etcd_endpoint=etcd.endpoint, etcd_root="/tidal", workdir=tmp_path, procs=procs,
    ).start()
    config = EtcdConfig(endpoints=[etcd.endpoint], root="/tidal", timeout_s=5.0)
    with create_client(config) as client, coordinator.client() as api:
        registered = Nodes(client)
        try:
            registered.add(*(f"n-{i}" for i in range(12)))
            wide = _submit(api, name="wide", **wide_spec)
            small = _submit(api, name="small")
            wait_for(lambda: _job(api, small)["phase"] == "RUNNING", timeout=30,
                     what=f"the small job RUNNING; log:\n{coordinator.log_tail()}")
            view = wait_for(lambda: (v := _job(api, wide))["phase"] == "FAILED" and v,
                            timeout=30, what="the wide job FAILED")
            assert view["exit_reason"] == "unschedulable"
            events = api.get(f"/v1/jobs/{wide}/events").json()["events"]
            refused = [e for e in events if e["reason"] == "write_failed"]
            assert refused and refusal in refused[-1]["message"], events
            finished = [c for c in view["conditions"]  # type: ignore[attr-defined]
                        if c["type"] == "Finished"]
            assert finished[0]["status"] is True and refusal in finished[0]["message"]
            assert _placed(client, wide) == {}
            assert api.get("/readyz").status_code == 200
            metrics = httpx.get(f"{coordinator.url}/metrics", timeout=5).text
            assert _metric(metrics, "tidal_coordinator_job_write_failures_total") >= 3
            assert _metric(metrics, "tidal_coordinator_jobs_abandoned_total") == 1
            assert _metric(metrics, "tidal_coordinator_reconcile_consecutive_failures") == 0
            # and the cluster keeps scheduling
            third = _submit(api, name="third")
            wait_for(lambda: _job(api, third)["phase"] == "RUNNING", timeout=30,
                     what="a job submitted afterwards RUNNING")
        finally:
            registered.close()


def test_a_job_of_300_nodes_places(
    coordinator: CoordinatorProcess, api: httpx.Client, etcd_client: EtcdClient
):
    keeper = LeaseKeeper(etcd_client, ttl_s=30).start()
    try:
        ids = [f"sim-{i:03d}" for i in range(300)]
        for start in range(0, len(ids), 100):
            etcd_client.txn([], [
                Put(etcd_client.keys.node(i),
                    NodeInfo(node_id=i, host="sim", address="127.0.0.1", slots=1).to_json(),
                    lease=keeper.lease_id)
                for i in ids[start:start + 100]
            ])
        job_id = _submit(api, name="wide", min_nodes=300, max_nodes=300)
        wait_for(lambda: len(_placed(etcd_client, job_id)) == 300, timeout=60,
                 what=f"300 assignments; log:\n{coordinator.log_tail()}")
        view = wait_for(lambda: (v := _job(api, job_id))["phase"] == "RUNNING" and v,
                        timeout=30, what="the job RUNNING")
        assert len(view["nodes"]) == 300  # type: ignore[arg-type]
        generations = [a.generation for a in _placed(etcd_client, job_id).values()]
        assert len(set(generations)) == 300
        assert f"job {job_id}: change of 303 operations written in 4 transactions" in (
            coordinator.log_path.read_text())
        metrics = httpx.get(f"{coordinator.url}/metrics", timeout=5).text
        assert _metric(metrics, "tidal_coordinator_job_write_failures_total") == 0
    finally:
        keeper.close()


# failing passes show -----------------------------------------------------------------------


@pytest.fixture
def small_etcd(tmp_path: Path, durable_etcd_binary: Path) -> Iterator[EtcdServer]:
    """A private etcd with a 4 MiB space quota."""
    server = EtcdServer(data_dir=tmp_path / "etcd-small", binary=durable_etcd_binary,
                        quota_backend_bytes=4 * 1024 * 1024)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def test_readyz_and_metrics_say_when_reconcile_passes_keep_failing(
    tmp_path: Path, small_etcd: EtcdServer, procs: ProcessGroupRegistry
):
    coordinator = CoordinatorProcess(
        etcd_endpoint=small_etcd.endpoint, etcd_root="/tidal", workdir=tmp_path, procs=procs,
    ).start()
    config = EtcdConfig(endpoints=[small_etcd.endpoint], root="/tidal", timeout_s=5.0)
    with create_client(config) as client, coordinator.client() as api:
        registered = Nodes(client)
        try:
            registered.add("n-1")
            job_id = _submit(api)
            wait_for(lambda: _job(api, job_id)["phase"] == "RUNNING", timeout=30,
                     what="the job RUNNING")
            wait_for(lambda: api.get("/readyz").status_code == 200, timeout=15, what="ready")
            # Fill etcd's quota: from then on every write that puts a key fails.
            filler = b"f" * (512 * 1024)
            with pytest.raises(EtcdNoSpaceError):
                for i in range(40):
                    client.put(f"/filler/{i}", filler)
            registered.remove("n-1")  # the node goes: the job's change cannot be written
            response = wait_for(
                lambda: (r := api.get("/readyz")).status_code == 503 and r, timeout=30,
                what=f"/readyz 503; log:\n{coordinator.log_tail()}")
            error = response.json()["error"]
            assert "reconcile passes failed" in error and "space" in error, error
            metrics = httpx.get(f"{coordinator.url}/metrics", timeout=5).text
            assert _metric(metrics, "tidal_coordinator_reconcile_failures_total") >= 3
            assert _metric(metrics, "tidal_coordinator_reconcile_consecutive_failures") >= 3
            assert _metric(metrics,
                           "tidal_coordinator_reconcile_last_success_timestamp_seconds") > 0
        finally:
            registered.close()


# assignments nobody wrote ------------------------------------------------------------------


def test_an_assignment_put_by_hand_for_a_job_that_does_not_exist_is_deleted(
    api: httpx.Client, nodes: Nodes, etcd_client: EtcdClient
):
    nodes.add("node-2")
    real = _submit(api, name="real")
    wait_for(lambda: _placed(etcd_client, real), timeout=20, what="the real job placed")
    keys = etcd_client.keys
    orphan = Assignment(job_id="x", generation=1, command=["touch", "/tmp/pwned"],
                        min_nodes=1, max_nodes=1)
    etcd_client.put(keys.assignment("node-2", "x"), orphan.model_dump_json().encode())
    # a body naming another job, and one that is no assignment at all
    etcd_client.put(keys.assignment("node-2", "y"), orphan.model_dump_json().encode())
    etcd_client.put(keys.assignment("node-2", "z"), b"not json")
    for job in ("x", "y", "z"):
        wait_for(lambda job=job: etcd_client.get(keys.assignment("node-2", job)) is None,
                 timeout=20, what=f"the stray assignment of {job} deleted")
    assert set(_placed(etcd_client, real)) == {"node-2"}


# when training started ---------------------------------------------------------------------


def test_the_training_condition_turns_true_at_the_first_reported_step(
    api: httpx.Client, nodes: Nodes, etcd_client: EtcdClient
):
    nodes.add("n-1")
    job_id = _submit(api)
    [assignment] = wait_for(lambda: list(_placed(etcd_client, job_id).values()), timeout=20,
                            what="the assignment")

    def report(last_step: int | None) -> None:
        status = JobNodeStatus(job_id=job_id, node_id="n-1", generation=assignment.generation,
                               state=JobNodeState.RUNNING, world_size=1, last_step=last_step)
        etcd_client.put(etcd_client.keys.status(job_id, "n-1"), status.model_dump_json().encode())

    def training() -> tuple[bool, str]:
        conditions = _job(api, job_id)["conditions"]
        [cond] = [c for c in conditions if c["type"] == "Training"]  # type: ignore[attr-defined]
        return cond["status"], cond["reason"]

    report(None)
    wait_for(lambda: _job(api, job_id)["phase"] == "RUNNING", timeout=20, what="RUNNING")
    assert training() == (False, "waiting_for_first_step")
    report(0)
    wait_for(lambda: training() == (True, "training_started"), timeout=20,
             what="the Training condition")


# the API's error shape ---------------------------------------------------------------------


def _is_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) <= {"error", "detail"} and isinstance(body["error"], str), body
    return str(body["error"])


def test_a_chunked_body_over_the_limit_is_a_413(api: httpx.Client):
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "x", "command": ["'
        for _ in range(20):
            yield b"a" * 100_000
        yield b'"]}'

    response = api.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert "larger than" in _is_error(response, 413)


def test_bodies_that_are_not_json_answer_in_the_error_shape(api: httpx.Client):
    headers = {"content-type": "application/json"}
    for body in (b'{"name": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000, b"{not json"):
        error = _is_error(api.post("/v1/jobs", content=body, headers=headers), 422)
        assert "not valid JSON" in error, error


def test_unknown_routes_and_methods_answer_in_the_error_shape(
    coordinator: CoordinatorProcess, api: httpx.Client
):
    _is_error(api.get("/v1/nope"), 404)
    with coordinator.client(token=None) as anonymous:
        _is_error(anonymous.get("/nope"), 404)
    _is_error(api.delete("/v1/jobs"), 405)
    _is_error(api.put("/v1/jobs/j-1"), 405)


def test_a_broken_body_without_a_token_is_a_401(coordinator: CoordinatorProcess):
    headers = {"content-type": "application/json"}
    for token in (None, "wrong-token-0123456789"):
        with coordinator.client(token=token) as client:
            response = client.post("/v1/jobs", content=b"{not json", headers=headers)
            assert "bearer token" in _is_error(response, 401)
            assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("value", ["2", True, 2.5])
@pytest.mark.parametrize("field", ["min_nodes", "max_nodes", "nproc_per_node"])
def test_numbers_given_as_strings_or_booleans_are_refused_naming_the_field(
    api: httpx.Client, field: str, value: object
):
    error = _is_error(api.post("/v1/jobs", json=job_spec(**{field: value})), 422)
    assert field in error, error


def test_a_scale_request_is_strict_too(api: httpx.Client):
    job_id = _submit(api)
    error = _is_error(api.patch(f"/v1/jobs/{job_id}", json={"max_nodes": "3"}), 422)
    assert "max_nodes" in error
