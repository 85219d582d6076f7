"""A rendezvous member in a process of its own, for tests that kill or stop one.

``python -m tests.support.rdzv_member ENDPOINT ROOT JOB NODE MIN MAX`` joins
the job's :class:`~rendezvous.elastic.assigned.AssignedRendezvousHandler` rendezvous
on 127.0.0.1, prints one JSON line ``{"round": R, "rank": K, "world": W}``
once its round completes, and then waits to be killed.
"""

from __future__ import annotations

import json
import sys
import threading

from rendezvous.elastic.assigned import AssignedRendezvousHandler
from rendezvous.etcd import EtcdConfig, create_client


def main(argv: list[str]) -> None:
    endpoint, root, job, node, low, high = argv
    client = create_client(EtcdConfig(endpoints=[endpoint], root=root, timeout_s=5))
    handler = AssignedRendezvousHandler(
        client, run_id=job, node_id=node, addr="127.0.0.1", min_nodes=int(low),
        max_nodes=int(high), root=root, lease_ttl_s=2,
    )
    info = handler.next_rendezvous()
    round_ = handler.participants()
    print(json.dumps({"rank": info.rank, "world": info.world_size, "members": sorted(round_)}),
          flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
