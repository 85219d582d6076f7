"""`make demo`: elastic training with plain torchrun on tidal's etcd-v3 rendezvous.

Starts a real etcd, then three torchrun "nodes" on loopback running an
ordinary DDP script (examples/elastic_ddp.py, no tidal code in it): two train
together, the first is SIGKILLed and the survivor carries on alone, a third
joins and the job grows back to two. Prints what happened and the recovery
times, then stops everything it started.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

from examples.torchrun_scenario import TorchrunCluster, run_kill_and_join
from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    start = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {message}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tidal-demo-") as tmp, EtcdServer() as etcd:
        say(f"etcd {etcd.version_text} ({etcd.binary}) listening on {etcd.endpoint}")
        cluster = TorchrunCluster(workdir=Path(tmp), etcd_endpoint=etcd.endpoint, run_id="demo")
        try:
            result = run_kill_and_join(cluster, say=say)
        except Exception as exc:
            say(f"demo failed: {exc}")
            for name in cluster.nodes:
                print(f"--- last lines of node {name}'s log ---\n{cluster.log_tail(name)}")
            return 1
        finally:
            cluster.kill_all()
        with create_client(EtcdConfig(endpoints=[etcd.endpoint])) as client:
            kvs, _ = client.get_prefix(client.keys.rdzv_prefix("demo"))
        sizes = sorted({(r["node"], r["world_size"]) for r in result.records})
        print()
        print("summary")
        print(f"  steps logged:                    {len(result.records)}")
        print(f"  (node, world size) seen:         {sizes}")
        print(f"  last step before the kill:       {result.last_step_before_kill}")
        print(f"  survivor's first step after it:  {result.first_step_after_kill}")
        print(f"  kill -> first step at size 1:    {result.kill_to_first_step_s:.1f} s")
        print(f"  join -> first step at size 2:    {result.join_to_first_step_s:.1f} s")
        print(f"  rendezvous keys in etcd:         {len(kvs)} (leased, they expire on their own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
