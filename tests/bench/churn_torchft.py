"""The torchft arm of the churn benchmark: examples/mlp.py's model and data under torchft.

Two commands, each run by tests/bench/bench_churn.py as its own process group::

    python -m tests.bench.churn_torchft lighthouse --site DIR --address-file F \\
        --heartbeat-timeout-ms 5000
    python -m tests.bench.churn_torchft replica --site DIR --lighthouse ADDR --replica N \\
        --ready-file R --go-file G

``lighthouse`` runs torchft's ``LighthouseServer`` on 127.0.0.1 (port 0, min 1
replica; the heartbeat timeout from the flag, join timeout and quorum tick at
torchft's defaults) and writes its address to ``--address-file`` (a file, not
a log line, for the parent to read). ``replica`` is one replica group of one
process: it imports torch and torchft, builds examples/mlp.py's MLP and
synthetic data, writes ``--ready-file`` and waits for ``--go-file`` (a spare
started a period early, as the tidal arm's spare agent with its warm runner),
then trains under torchft's recommended loop for the installed version:
``Manager`` (its own TCPStore, ``ProcessGroupGloo``), its
``DistributedDataParallel`` and ``OptimizerWrapper`` (``zero_grad`` starts
the quorum, ``step`` asks ``should_commit`` and steps only if every replica
may). A step is paced like examples/mlp.py's ``--step-seconds`` (a sleep after
it). Each replica takes a fixed local batch of 11 samples (the reference's
global batch of 32 over 3 ranks, rounded up), drawn by step and participating
rank; torchft's DDP averages over the participants. Each step logs one line,
``replica N step S committed C participants P``, S being the manager's step
after it (the committed steps of the job).

torchft is no tidal dependency: ``make torchft-site`` installs it (and the
OpenTelemetry packages it imports, not torch) into ``build/torchft-site``;
``--site`` appends that folder to ``sys.path``, after the venv's packages.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

LOCAL_BATCH = 11
log = logging.getLogger("churn_torchft")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True, help="where torchft is installed")
    sub = parser.add_subparsers(dest="command", required=True)
    lighthouse = sub.add_parser("lighthouse")
    lighthouse.add_argument("--address-file", type=Path, required=True)
    lighthouse.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    replica = sub.add_parser("replica")
    replica.add_argument("--lighthouse", required=True)
    replica.add_argument("--replica", type=int, required=True)
    replica.add_argument("--ready-file", type=Path, required=True)
    replica.add_argument("--go-file", type=Path, required=True)
    replica.add_argument("--step-seconds", type=float, default=0.1)
    replica.add_argument("--dataset-size", type=int, default=4096)
    replica.add_argument("--pg-timeout-s", type=float, default=10.0)
    replica.add_argument("--timeout-s", type=float, default=30.0)
    return parser.parse_args(argv)


def run_lighthouse(args: argparse.Namespace) -> None:
    """Serve the lighthouse until killed; its address goes to ``--address-file``."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    address = server.address()
    tmp = args.address_file.with_name(args.address_file.name + ".tmp")
    tmp.write_text(address)
    tmp.replace(args.address_file)
    log.info("lighthouse at %s, heartbeat timeout %d ms", address, args.heartbeat_timeout_ms)
    while True:
        time.sleep(3600)


def run_replica(args: argparse.Namespace) -> None:
    """One replica group of one process, training until killed."""
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from examples.mlp import SyntheticRegression, make_model

    dtype = torch.float32
    model_args = argparse.Namespace(seed=0, features=8, hidden=32)
    model = make_model(model_args, dtype)
    dataset = SyntheticRegression(size=args.dataset_size, features=8, dtype=dtype)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    args.ready_file.touch()
    while not args.go_file.exists():
        time.sleep(0.05)
    log.info("replica %d joins", args.replica)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)),
        load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        timeout=timedelta(seconds=args.timeout_s), store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
        replica_id=f"churn_{args.replica}", hostname="127.0.0.1",
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    while True:
        optimizer.zero_grad()  # starts the quorum
        step = manager.current_step()
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(step))
        slot = manager.participating_rank() or 0
        index = order[slot * LOCAL_BATCH:(slot + 1) * LOCAL_BATCH]
        x, y = dataset.x[index], dataset.y[index]
        loss = ((ddp(x) - y) ** 2).sum(dim=1).mean()
        loss.backward()
        optimizer.step()  # should_commit, then the inner step if every replica may
        committed = manager.current_step() > step
        log.info("replica %d step %d committed %s participants %d loss %.6f", args.replica,
                 manager.current_step(), committed, manager.num_participants(), loss.item())
        if args.step_seconds:
            time.sleep(args.step_seconds)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [pid %(process)d] %(message)s")
    sys.path.append(str(args.site.resolve()))  # after the venv's own packages
    if args.command == "lighthouse":
        run_lighthouse(args)
    else:
        run_replica(args)


if __name__ == "__main__":
    main()
