"""Benchmark: the coordinator's API latency, reconcile time and memory at scale.

Run with ``make bench`` or
``.venv/bin/python -m pytest tests/bench/bench_coordinator.py -m bench -s``.

A real etcd and a real coordinator process (uvicorn). It measures:

* failover of a node in a small cluster: from the revocation of a node's
  lease to its job's new assignment (on a spare node) being written;
* with 500 simulated nodes (leased node records, no workers) and 2,000 jobs
  in etcd: API latency (p50, p99) of submit and get under a paced load of
  100 requests/s from 8 concurrent clients; the reconcile pass duration (the
  coordinator's own histogram); the time from a node's lease expiry to its
  assignment being removed (the job falls back to PENDING: no node is free);
  the coordinator's resident memory.

It prints a table; docs/benchmarks.md holds the figures. No assertion on time.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from rendezvous.etcd import EtcdClient, EtcdConfig, Put, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.lease import LeaseKeeper
from rendezvous.registry import NodeInfo
from tests.support.coordinator import CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

NODES, JOBS, RATE, CLIENTS, LOAD_SECONDS = 500, 2000, 100.0, 8, 10.0


def _put_nodes(client: EtcdClient, lease: int, ids: list[str]) -> None:
    for start in range(0, len(ids), 100):
        ops = [
            Put(client.keys.node(i),
                NodeInfo(node_id=i, host="sim", address="127.0.0.1", slots=1).to_json(),
                lease=lease)
            for i in ids[start:start + 100]
        ]
        client.txn([], ops)


def _placed_on(client: EtcdClient, node: str) -> list[str]:
    kvs, _ = client.get_prefix(client.keys.node_assignments_prefix(node))
    return [kv.key for kv in kvs]


def _job_on(client: EtcdClient, job_id: str) -> set[str]:
    prefix = client.keys.assignments_prefix()
    kvs, _ = client.get_prefix(prefix)
    return {kv.key[len(prefix):].split("/")[0] for kv in kvs if kv.key.endswith("/" + job_id)}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _paced_load(url: str, token: str, job_ids: list[str]) -> dict[str, list[float]]:
    """CLIENTS threads, RATE requests/s in all, half submits and half gets."""
    latencies: dict[str, list[float]] = {"submit": [], "get": []}
    lock = threading.Lock()
    interval = CLIENTS / RATE
    stop_at = time.monotonic() + LOAD_SECONDS

    def client_loop(index: int) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            next_at = time.monotonic() + index * interval / CLIENTS
            n = 0
            while next_at < stop_at:
                time.sleep(max(0.0, next_at - time.monotonic()))
                kind = "submit" if (n + index) % 2 == 0 else "get"
                started = time.perf_counter()
                if kind == "submit":
                    response = api.post("/v1/jobs", json=job_spec(f"load{index}"))
                else:
                    response = api.get(f"/v1/jobs/{job_ids[(n * 7 + index) % len(job_ids)]}")
                elapsed = time.perf_counter() - started
                assert response.status_code < 300, response.text
                with lock:
                    latencies[kind].append(elapsed)
                n += 1
                next_at += interval

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def _reconcile_seconds(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = float(re.search(r"reconcile_duration_seconds_sum (\S+)", text).group(1))  # type: ignore[union-attr]
    count = float(re.search(r"reconcile_duration_seconds_count (\S+)", text).group(1))  # type: ignore[union-attr]
    return total, count


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _node_loss(client: EtcdClient, node: str, keeper: LeaseKeeper, job_id: str,
               *, replaced: bool) -> float:
    """Seconds from revoking ``node``'s lease to the scheduler's write that follows."""
    started = time.monotonic()
    keeper.close(revoke=True)

    def done() -> bool:
        on = _job_on(client, job_id)
        return node not in on and (bool(on) if replaced else True)

    wait_for(done, timeout=60, what=f"job {job_id} moved off {node}", interval=0.005)
    return time.monotonic() - started


@pytest.mark.bench
@pytest.mark.timeout(1200)
def test_bench_coordinator(tmp_path: Path, etcd_server: EtcdServer) -> None:
    procs = ProcessGroupRegistry()
    config = EtcdConfig(endpoints=[etcd_server.endpoint], root="/tidal-bench", timeout_s=30)
    rows: list[tuple[str, str]] = []
    try:
        coordinator = CoordinatorProcess(
            etcd_endpoint=etcd_server.endpoint, etcd_root="/tidal-bench", workdir=tmp_path,
            procs=procs,
        ).start()
        wait_for(coordinator.is_leader, timeout=15, what="leadership")
        assert coordinator.process is not None
        with create_client(config) as client, coordinator.client() as api:
            # Small cluster: a node dies, its job moves to the spare one.
            keepers = {n: LeaseKeeper(client, ttl_s=30).start() for n in ("s-1", "s-2")}
            for node, keeper in keepers.items():
                _put_nodes(client, keeper.lease_id, [node])
            small = api.post("/v1/jobs", json=job_spec("small")).json()["job_id"]
            first = wait_for(lambda: _job_on(client, small), timeout=60,
                             what=f"small placed; coordinator log:\n{coordinator.log_tail()}")
            victim = next(iter(first))
            moved = _node_loss(client, victim, keepers[victim], small, replaced=True)
            rows.append(("small cluster: lease revoked -> job reassigned on spare (s)",
                         f"{moved:.3f}"))

            # Scale: 500 nodes, 2,000 jobs.
            bulk = LeaseKeeper(client, ttl_s=60).start()
            ids = [f"sim-{i:04d}" for i in range(NODES - 1)]
            _put_nodes(client, bulk.lease_id, ids)
            lone = LeaseKeeper(client, ttl_s=60).start()
            _put_nodes(client, lone.lease_id, ["lone"])
            submit_times = []
            job_ids = []
            for i in range(JOBS):
                started = time.perf_counter()
                response = api.post("/v1/jobs", json=job_spec(f"j{i}"))
                submit_times.append(time.perf_counter() - started)
                job_ids.append(response.json()["job_id"])
            rows.append((f"{JOBS} sequential submits: p50 / p99 (ms)",
                         f"{1000 * statistics.median(submit_times):.1f} / "
                         f"{1000 * _percentile(submit_times, 0.99):.1f}"))
            wait_for(lambda: len(client.get_prefix(client.keys.assignments_prefix())[0])
                     >= NODES - 1, timeout=120, what="every node busy")
            total0, count0 = _reconcile_seconds(coordinator.url)
            latencies = _paced_load(coordinator.url, coordinator.token_file.read_text(), job_ids)
            for kind in ("submit", "get"):
                values = latencies[kind]
                rows.append((f"{RATE:.0f} req/s, {CLIENTS} clients: {kind} p50 / p99 (ms)",
                             f"{1000 * statistics.median(values):.1f} / "
                             f"{1000 * _percentile(values, 0.99):.1f}"))
            total1, count1 = _reconcile_seconds(coordinator.url)
            if count1 > count0:
                rows.append(("reconcile pass under that load, mean (s)",
                             f"{(total1 - total0) / (count1 - count0):.3f}"))
            lone_job = wait_for(lambda: [k.rsplit("/", 1)[1] for k in _placed_on(client, "lone")],
                                timeout=60, what="a job on the lone node")[0]
            lost = _node_loss(client, "lone", lone, lone_job, replaced=False)
            rows.append((f"{NODES} nodes / {JOBS}+ jobs: lease revoked -> assignment removed (s)",
                         f"{lost:.3f}"))
            total2, count2 = _reconcile_seconds(coordinator.url)
            rows.append(("reconcile pass at that scale, mean over the run (s)",
                         f"{total2 / max(count2, 1):.3f}"))
            rows.append(("coordinator resident memory (MB)",
                         f"{_rss_mb(coordinator.process.pid):.0f}"))
            bulk.close()
            for keeper in keepers.values():
                if keeper.alive:
                    keeper.close()
    finally:
        procs.stop_all()
    width = max(len(r[0]) for r in rows)
    print("\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in rows))
