"""Queues over the real API: a real etcd, a real coordinator process, nodes
registered straight into etcd (leased records, no agents)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd import EtcdClient
from rendezvous.etcd.server import EtcdServer
from rendezvous.registry import NodeInfo, NodeRegistration, NodeRegistry
from service.client import AsyncClient, Client, ConflictError, ForbiddenError, NotFoundError
from tests.support.coordinator import TOKEN, CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

TEAM_A_TOKEN = "team-a-token-0123456789"


@pytest.fixture
def coordinator(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> CoordinatorProcess:
    tokens = tmp_path / "queue-tokens"
    tokens.write_text(f"# team a's token\na {TEAM_A_TOKEN}\n")
    return CoordinatorProcess(
        etcd_endpoint=etcd_server.endpoint, etcd_root=etcd_root, workdir=tmp_path, procs=procs,
        extra=("--queue-tokens-file", str(tokens)),
    ).start()


@pytest.fixture
def nodes(etcd_client: EtcdClient) -> Iterator[None]:
    """Three live one-slot nodes."""
    registry = NodeRegistry(etcd_client)
    held: list[NodeRegistration] = [
        registry.register(NodeInfo(node_id=f"n{i}", host="h", address="127.0.0.1", slots=1),
                          ttl_s=5)
        for i in range(3)
    ]
    yield
    for registration in held:
        registration.close()


def _queue(api: httpx.Client, name: str) -> dict[str, Any]:
    [found] = [q for q in api.get("/v1/queues").json()["queues"] if q["name"] == name]
    return found  # type: ignore[no-any-return]


def test_queues_are_created_listed_changed_and_deleted_by_the_admin(
    coordinator: CoordinatorProcess, nodes: None
) -> None:
    with coordinator.client() as api:
        assert api.post("/v1/queues", json={"name": "a", "guaranteed": 2}).status_code == 201
        made = api.post("/v1/queues", json={"name": "b", "guaranteed": 1, "weight": 2.0})
        assert made.status_code == 201 and made.json()["warning"] is None
        listed = api.get("/v1/queues").json()
        assert [q["name"] for q in listed["queues"]] == ["a", "b", "default"]
        assert (listed["capacity"], listed["guaranteed_total"]) == (3, 3)
        # More guaranteed than the cluster holds: allowed, and said.
        over = api.post("/v1/queues", json={"name": "c", "guaranteed": 5})
        assert over.status_code == 201
        assert "add up to 8 slots but the cluster has 3" in over.json()["warning"]
        assert api.get("/v1/queues").json()["warning"] is not None
        refused = {
            "duplicate": api.post("/v1/queues", json={"name": "a"}),
            "bad name": api.post("/v1/queues", json={"name": "../x"}),
            "limit below guarantee": api.post("/v1/queues",
                                              json={"name": "d", "guaranteed": 3, "limit": 2}),
            "not a number": api.post("/v1/queues", json={"name": "d", "guaranteed": "3"}),
            "patch below guarantee": api.patch("/v1/queues/a", json={"limit": 1}),
            "null guarantee": api.patch("/v1/queues/a", json={"guaranteed": None, "limit": 9}),
            "unknown": api.get("/v1/queues/nope"),
        }
        codes = {what: r.status_code for what, r in refused.items()}
        assert codes == {"duplicate": 409, "bad name": 422, "limit below guarantee": 422,
                         "not a number": 422, "patch below guarantee": 422,
                         "null guarantee": 422, "unknown": 404}
        assert "limit (1) is less than guaranteed (2)" in refused["patch below guarantee"].text
        assert "guaranteed cannot be null" in refused["null guarantee"].text
        patched = api.patch("/v1/queues/c", json={"guaranteed": 0, "limit": 1})
        assert patched.status_code == 200, patched.text
        assert (patched.json()["queue"]["limit"], patched.json()["warning"]) == (1, None)
        # A job in c: the queue cannot go while the job is unfinished.
        job = api.post("/v1/jobs", json=job_spec(queue="c")).json()
        busy = api.delete("/v1/queues/c")
        assert busy.status_code == 409 and job["job_id"] in busy.json()["error"]
        assert api.post(f"/v1/jobs/{job['job_id']}/cancel").status_code == 202
        wait_for(lambda: api.delete("/v1/queues/c").status_code == 200, timeout=20,
                 what="queue c deleted once its job was cancelled")
        assert api.get("/v1/queues/c").status_code == 404
        assert api.delete("/v1/queues/default").status_code == 409
        # A job of a queue that does not exist is refused, naming it.
        unknown = api.post("/v1/jobs", json=job_spec(queue="nope"))
        assert unknown.status_code == 422 and "queue nope does not exist" in unknown.text


def test_the_queue_list_shows_what_a_borrowing_queue_holds(
    coordinator: CoordinatorProcess, nodes: None
) -> None:
    with coordinator.client() as api:
        api.post("/v1/queues", json={"name": "b", "guaranteed": 1})
        api.post("/v1/jobs", json=job_spec(queue="b", min_nodes=1, max_nodes=3))
        api.post("/v1/jobs", json=job_spec(queue="b", min_nodes=4, max_nodes=4))
        wait_for(lambda: _queue(api, "b")["in_use"] == 3, timeout=20,
                 what="queue b's elastic job on all three nodes")
        b = _queue(api, "b")
        assert (b["guaranteed"], b["borrowed"], b["waiting"]) == (1, 2, 4)
        assert (b["jobs_running"], b["jobs_waiting"]) == (1, 1)


def test_a_queue_token_uses_only_its_queues_and_cannot_manage_queues_or_nodes(
    coordinator: CoordinatorProcess, nodes: None
) -> None:
    with coordinator.client() as admin, coordinator.client(TEAM_A_TOKEN) as team:
        for name in ("a", "b"):
            assert admin.post("/v1/queues", json={"name": name}).status_code == 201
        theirs = admin.post("/v1/jobs", json=job_spec(queue="b")).json()["job_id"]
        mine = team.post("/v1/jobs", json=job_spec(queue="a"))
        assert mine.status_code == 201, mine.text
        ours = mine.json()["job_id"]
        refused = {
            "submit to b": team.post("/v1/jobs", json=job_spec(queue="b")),
            "read b's job": team.get(f"/v1/jobs/{theirs}"),
            "b's events": team.get(f"/v1/jobs/{theirs}/events"),
            "scale b's job": team.patch(f"/v1/jobs/{theirs}", json={"max_nodes": 2}),
            "cancel b's job": team.post(f"/v1/jobs/{theirs}/cancel"),
            "read queue b": team.get("/v1/queues/b"),
        }
        for what, response in refused.items():
            assert response.status_code == 403, (what, response.text)
            assert "queue b" in response.json()["error"], what
        admin_only = {
            "create a queue": team.post("/v1/queues", json={"name": "x"}),
            "change its own queue": team.patch("/v1/queues/a", json={"guaranteed": 3}),
            "delete a queue": team.delete("/v1/queues/b"),
            "drain a node": team.post("/v1/nodes/n0/drain"),
        }
        for what, response in admin_only.items():
            assert response.status_code == 403, (what, response.text)
            assert "only the admin token" in response.json()["error"], what
        assert [j["job_id"] for j in team.get("/v1/jobs").json()["jobs"]] == [ours]
        assert [q["name"] for q in team.get("/v1/queues").json()["queues"]] == ["a"]
        assert team.get(f"/v1/jobs/{ours}").status_code == 200
        assert team.post(f"/v1/jobs/{ours}/cancel").status_code == 202
        assert admin.get(f"/v1/jobs/{theirs}").json()["phase"] != "CANCELLED"
        assert {j["job_id"] for j in admin.get("/v1/jobs").json()["jobs"]} == {ours, theirs}
        assert admin.get("/v1/queues/b").status_code == 200


def _tidal(coordinator: CoordinatorProcess, tmp_path: Path, *args: str,
           token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update(TIDAL_URL=coordinator.url, TIDAL_TOKEN=token, TIDAL_HOME=str(tmp_path / "home"))
    return subprocess.run([sys.executable, "-m", "service.cli", *args], env=env, text=True,
                          capture_output=True, timeout=60, check=False)


@pytest.mark.slow  # 37 s under load: a CLI process per command
def test_the_queue_commands_and_submit_to_a_queue(
    coordinator: CoordinatorProcess, nodes: None, tmp_path: Path
) -> None:
    made = _tidal(coordinator, tmp_path, "queue", "create", "a", "--guaranteed", "2",
                  "--limit", "3", "--weight", "2")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "created queue a: guaranteed 2, limit 3, weight 2"
    over = _tidal(coordinator, tmp_path, "queue", "create", "b", "--guaranteed", "2")
    assert over.returncode == 0 and "warning: the queues' guarantees add up to 4" in over.stderr
    job = _tidal(coordinator, tmp_path, "submit", "--queue", "a", "--no-wait", "--",
                 sys.executable, "-c", "pass")
    assert job.returncode == 0, job.stderr
    listed = _tidal(coordinator, tmp_path, "queue", "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert rows["a"][:4] == ["a", "2", "3", "2"] and rows["default"][1:3] == ["0", "-"]
    assert "capacity 3 slot(s), 4 guaranteed" in listed.stdout
    assert "warning:" in listed.stderr
    as_json = json.loads(_tidal(coordinator, tmp_path, "queue", "list", "--json").stdout)
    assert {q["name"] for q in as_json["queues"]} == {"a", "b", "default"}
    changed = _tidal(coordinator, tmp_path, "queue", "set", "a", "--no-limit", "--weight", "3")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.strip() == "changed queue a: guaranteed 2, limit none, weight 3"
    nothing = _tidal(coordinator, tmp_path, "queue", "set", "a")
    assert nothing.returncode == 2 and "give --guaranteed" in nothing.stderr
    unknown = _tidal(coordinator, tmp_path, "submit", "--queue", "nope", "--no-wait", "--",
                     sys.executable, "-c", "pass")
    assert unknown.returncode != 0 and "queue nope does not exist" in unknown.stderr
    assert _tidal(coordinator, tmp_path, "queue", "delete", "b").returncode == 0
    busy = _tidal(coordinator, tmp_path, "queue", "delete", "a")
    assert busy.returncode != 0 and "unfinished jobs" in busy.stderr
    scoped = _tidal(coordinator, tmp_path, "queue", "create", "x", token=TEAM_A_TOKEN)
    assert scoped.returncode != 0 and "only the admin token may manage queues" in scoped.stderr


def test_the_python_clients_manage_queues_like_the_commands(
    coordinator: CoordinatorProcess, nodes: None, tmp_path: Path
) -> None:
    with Client(coordinator.url, TOKEN, state_dir=tmp_path) as tidal:
        made = tidal.create_queue("a", guaranteed=2, limit=3, weight=2)
        assert (made.queue.guaranteed, made.queue.limit, made.queue.weight) == (2, 3, 2.0)
        assert made.warning is None
        over = tidal.create_queue("b", guaranteed=2)
        assert over.warning is not None and "add up to 4" in over.warning
        with pytest.raises(ConflictError):
            tidal.create_queue("a")
        changed = tidal.update_queue("a", limit=None, weight=0.5)
        assert (changed.queue.limit, changed.queue.weight) == (None, 0.5)
        with pytest.raises(ValueError, match="no setting colour"):
            tidal.update_queue("a", colour="red")
        with pytest.raises(NotFoundError):
            tidal.update_queue("nope", weight=1.0)
        assert {q.name for q in tidal.queues().queues} == {"a", "b", "default"}
        assert tidal.delete_queue("b").name == "b"
    with Client(coordinator.url, TEAM_A_TOKEN, state_dir=tmp_path) as team, \
            pytest.raises(ForbiddenError):
        team.create_queue("x")

    async def the_twin() -> set[str]:
        async with AsyncClient(coordinator.url, TOKEN, state_dir=tmp_path) as tidal:
            await tidal.update_queue("a", guaranteed=1)
            await tidal.create_queue("c")
            await tidal.delete_queue("c")
            return {f"{q.name}:{q.guaranteed}" for q in (await tidal.queues()).queues}

    assert asyncio.run(the_twin()) == {"a:1", "default:0"}
