"""A host cut off from the network mid-training, then reconnected.

Three agents on three hosts train examples/elastic_ddp.py (DDP over gloo
between the hosts) as one job of min 1, max 3 nodes. The host holding global
rank 0 (the workers' master, the worst one to lose) is cut off: its link goes
down, every process on it keeps running. The others must notice within the
lease TTL plus the rendezvous' keep-alive window and train on at world size 2,
well before gloo's own timeout (30 s in the script) would have told them. When
the link comes back, the node's stale runner and workers are stopped, the node
registers again, rejoins, and the job runs at world size 3 again, with no rank
trained by two nodes at once.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

import pytest

from tests.netns.cluster import (
    LEASE_TTL_S,
    NetnsCluster,
    duplicate_ranks,
    step_events,
    wait_first_step_at,
    wait_steps,
)
from tests.support.wait import wait_for

log = logging.getLogger(__name__)

#: The runners drop a peer after keep_alive_interval x keep_alive_max_attempt (1 s x 5),
#: the coordinator after the node's lease TTL; a new round and new workers need more.
DETECT_BOUND_S = 30.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cut_off_host_is_dropped_then_rejoins_without_duplicate_ranks(
    cluster: NetnsCluster,
) -> None:
    api = cluster.api
    job_id = api.submit(cluster.elastic_ddp_spec("cut"))
    events = cluster.events_path("cut")
    wait_for(lambda: api.running_at(job_id, 3), timeout=120, interval=0.3,
             what="RUNNING at world size 3")
    wait_steps(events, 10, timeout=60)
    victim = cluster.node_of_rank(job_id, 0)
    host = cluster.agent_hosts[victim]
    pids_before = set(cluster.net.pids(host))
    before = api.job(job_id)

    cut_at = time.time()
    cluster.net.cut(host)
    wait_for(lambda: api.running_at(job_id, 2), timeout=90, interval=0.3,
             what="RUNNING at world size 2 without the cut-off host")
    first = wait_first_step_at(events, 2, after=cut_at, timeout=60,
                               what="a step at world size 2 after the cut")
    recovery = first["time"] - cut_at
    log.info("cut %s -> first step at world size 2: %.1f s", victim, recovery)
    assert recovery < DETECT_BOUND_S, recovery
    view = api.job(job_id)
    assert victim not in {n["node_id"] for n in view["nodes"]}, view["nodes"]
    lost = next(e for e in api.events(job_id) if e["reason"] == "node_lost")
    noticed = datetime.fromisoformat(lost["time"].replace("Z", "+00:00")).timestamp() - cut_at
    log.info("cut %s -> the coordinator drops it: %.1f s", victim, noticed)
    assert noticed < LEASE_TTL_S + 5, noticed
    assert view["restarts"].get("node_lost", 0) > before["restarts"].get("node_lost", 0)
    wait_steps(events, 10, timeout=60, what="10 steps at world size 2")
    # A partition kills nothing: the cut-off host's agent still runs.
    agent = cluster.agents[victim]
    assert agent.poll() is None and agent.pid in cluster.net.pids(host)
    assert pids_before & set(cluster.net.pids(host))

    healed_at = time.time()
    cluster.net.heal(host)
    wait_for(lambda: api.running_at(job_id, 3), timeout=120, interval=0.3,
             what="RUNNING at world size 3 again after the heal")
    back = wait_first_step_at(events, 3, after=healed_at, timeout=60,
                              what="a step at world size 3 after the heal")
    log.info("heal -> first step at world size 3: %.1f s", back["time"] - healed_at)
    assert victim in {n["node_id"] for n in api.job(job_id)["nodes"]}
    wait_steps(events, 10, timeout=60, what="10 steps at world size 3 after the rejoin")

    records = step_events(events)
    # No step of the cut-off host's stale group after the cut (a margin for the
    # step in flight) and no rank trained by two nodes at once, ever.
    stale = [r for r in records if r["node"] == victim and cut_at + 2 < r["time"] < healed_at]
    assert not stale, stale[:5]
    assert not duplicate_ranks(records)
    rejoined = [r for r in records if r["time"] > back["time"]]
    by_step: dict[int, list[int]] = {}
    for r in rejoined:
        by_step.setdefault(r["step"], []).append(r["rank"])
    full = [ranks for ranks in by_step.values() if len(ranks) == 3]
    assert full and all(sorted(ranks) == [0, 1, 2] for ranks in full), by_step
    reasons = [e["reason"] for e in api.events(job_id)]
    assert "node_lost" in reasons and "node_joined" in reasons[reasons.index("node_lost"):]
    assert api.job(job_id)["phase"] == "RUNNING"
    # It came back on a new lease, registered again by the same agent process.
    registrations = cluster.tail(f"agent-{victim}.log", lines=10_000).count(
        f"node {victim} registered under lease")
    assert registrations >= 2, registrations
