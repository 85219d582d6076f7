"""A slow, lossy link under one training host must not be mistaken for a lost node.

One agent host's link drops 10% of the packets both ways (and, where the kernel
has netem, adds 200 ms each way) for 30 s while the job trains at world size
3. Training slows down but goes on; the node keeps its lease, no rendezvous
round drops it, the job is never rescaled and no worker restarts.
"""

from __future__ import annotations

import logging
import time

import pytest

from tests.netns.cluster import NetnsCluster, last_step, step_events, wait_steps
from tests.support.netns import netem_unavailable_reason
from tests.support.wait import wait_for

log = logging.getLogger(__name__)
DEGRADED_S = 30.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lossy_link_causes_no_spurious_rescale(cluster: NetnsCluster) -> None:
    api = cluster.api
    job_id = api.submit(cluster.elastic_ddp_spec("lossy"))
    events = cluster.events_path("lossy")
    wait_for(lambda: api.running_at(job_id, 3), timeout=120, interval=0.3,
             what="RUNNING at world size 3")
    wait_steps(events, 5, timeout=60)
    history = api.events(job_id)
    view = api.job(job_id)
    victim = cluster.node_of_rank(job_id, 0)
    host = cluster.agent_hosts[victim]

    delay_ms = 200 if netem_unavailable_reason() is None else 0
    how = cluster.net.degrade(host, delay_ms=delay_ms, loss_pct=10.0)
    degraded_at = time.time()
    step_at_start = last_step(events)
    try:
        while time.time() - degraded_at < DEGRADED_S:
            time.sleep(1)
            assert cluster.agents[victim].poll() is None
        steps = last_step(events) - step_at_start
    finally:
        cluster.net.heal(host)
    log.info("%s on %s's link for %.0f s: %d steps (delay %d ms)", how, victim, DEGRADED_S,
             steps, delay_ms)
    assert steps > 0, "training stopped on the lossy link"
    wait_steps(events, 10, timeout=60)
    assert cluster.nodes() == set(cluster.agent_hosts)
    assert api.events(job_id) == history, "the job was rescaled"
    after = api.job(job_id)
    assert (after["phase"], after["world_size"], after["restarts"]) == (
        "RUNNING", 3, view["restarts"])
    restarts = {r["restarts"] for r in step_events(events, after=degraded_at)}
    assert restarts == {0}, "the workers were restarted"
