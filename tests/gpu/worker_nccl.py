"""Part 6's workers: NCCL's process group, its abort, and the live re-form, timed.

``python -m tests.gpu.worker_nccl MODE RESULT.json [options]``; each mode
writes its result (and, along the way, how far it got) to ``RESULT.json``:

* ``group``: a NCCL process group of one rank on GPU 0: init, one all-reduce;
* ``abort-live``: such a group, aborted by ``checkpoints.nccl.abort_on_stop`` after a
  SIGTERM, then a collective on it, which must raise (one GPU has no peer to die;
  ``abort-dead-peer`` is the real case);
* ``abort-dead-peer`` (``--rank 0|1``, two GPUs): rank 1 dies after a first
  all-reduce while rank 0 blocks in the second; the check SIGTERMs rank 0 and times its exit;
* ``reform-nccl``: a NCCL group of one rank re-formed in place by
  ``checkpoints.live``'s ``rejoin`` into the next round (another port), then an all-reduce;
* ``transfer`` (``--rank 0|1``): the live join on gloo with the state on the GPU
  (CUDA tensors; CPU tensors in a dry run): rank 0 trains alone in round 1, both
  re-form into round 2 (rank 0 through ``rejoin``, rank 1 as a joiner) and
  ``sync_state`` sends rank 0's model and AdamW state to rank 1, which compares.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

TIMEOUT = datetime.timedelta(seconds=60)
EXIT_ABORTED = 75


class Result:
    """The result file, rewritten after every stage (a killed run leaves how far it got)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"stages": []}

    def stage(self, name: str, **values: Any) -> None:
        self.data["stages"].append(name)
        self.data.update(values)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def live_names() -> tuple[Any, Any, Any]:
    """``rejoin``, ``sync_state`` and ``ResizeNotice``, before or after the move (#23)."""
    from tests.gpu import compat

    rejoin = compat.name("checkpoints.live.group", "checkpoints.live_group", "rejoin")
    sync_state = compat.name("checkpoints.live.sync", "checkpoints.live_sync", "sync_state")
    notice = compat.name("checkpoints.protocol.live", "rendezvous.live_files", "ResizeNotice")
    return rejoin, sync_state, notice


def init(backend: str, port: int, rank: int = 0, world_size: int = 1) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=TIMEOUT, device_id=device)


def all_reduce_value(device: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 20, device=device)
    dist.all_reduce(t)
    return float(t[0].item())  # waits for the device


def mode_group(res: Result, args: argparse.Namespace) -> None:
    import torch

    torch.cuda.set_device(0)
    started = time.perf_counter()
    init("nccl", args.port)
    value = all_reduce_value("cuda")
    version = torch.cuda.nccl.version()
    res.stage("group", init_and_first_all_reduce_s=time.perf_counter() - started, value=value,
              nccl_version=".".join(map(str, version)) if isinstance(version, tuple)
              else str(version))


def mode_abort_live(res: Result, args: argparse.Namespace) -> None:
    import torch

    from checkpoints import nccl

    torch.cuda.set_device(0)
    nccl.prepare_environment()
    init("nccl", args.port)
    all_reduce_value("cuda")
    signal.signal(signal.SIGTERM, lambda *_: None)  # as the checkpoints library does
    watcher = nccl.abort_on_stop(delay_s=0.2)
    res.stage("group")
    sent = time.perf_counter()
    os.kill(os.getpid(), signal.SIGTERM)
    if not watcher.aborted.wait(10):
        res.stage("not aborted", error="no abort within 10 s of the SIGTERM")
        return
    res.stage("aborted", abort_s=time.perf_counter() - sent)
    try:
        all_reduce_value("cuda")
    except Exception as exc:  # what a worker blocked in a collective sees
        res.stage("collective raised", error_type=type(exc).__name__, raised=str(exc)[:300])
    else:
        res.stage("collective completed", error="a collective on the aborted group completed")


def mode_abort_dead_peer(res: Result, args: argparse.Namespace) -> None:
    import torch

    from checkpoints import nccl

    torch.cuda.set_device(args.rank)
    nccl.prepare_environment()
    init("nccl", args.port, args.rank, 2)
    signal.signal(signal.SIGTERM, lambda *_: None)
    nccl.abort_on_stop(delay_s=0.5)
    all_reduce_value("cuda")
    if args.rank == 1:
        os._exit(1)  # the peer dies
    res.stage("blocked")
    try:
        all_reduce_value("cuda")
    except Exception as exc:
        res.stage("collective raised", error_type=type(exc).__name__)
        os._exit(EXIT_ABORTED)
    res.stage("collective completed")
    os._exit(0)


def mode_reform_nccl(res: Result, args: argparse.Namespace) -> None:
    import torch

    rejoin, _, notice_type = live_names()
    torch.cuda.set_device(0)
    init("nccl", args.port)
    all_reduce_value("cuda")
    res.stage("round 1")
    notice = notice_type(round=2, master_addr="127.0.0.1", master_port=args.port2,
                         world_size=1, ranks={0: 0}, written_at=time.time())
    started = time.perf_counter()
    rank, world = rejoin(notice, local_rank=0)
    value = all_reduce_value("cuda")
    res.stage("round 2", rejoin_and_all_reduce_s=time.perf_counter() - started, rank=rank,
              world_size=world, value=value)


def mode_lost_nccl(res: Result, args: argparse.Namespace) -> None:
    """The live path's NCCL abort: the runner's lost notice aborts the group's communicators
    (``checkpoints.live.unblock``), a collective then raises, and the rank re-forms in place."""
    import tempfile

    import torch

    from checkpoints import nccl
    from checkpoints.live.unblock import Unblocker
    from checkpoints.protocol.live import write_lost_notice

    rejoin, _, notice_type = live_names()
    torch.cuda.set_device(0)
    nccl.prepare_environment()
    init("nccl", args.port)
    all_reduce_value("cuda")
    directory = Path(tempfile.mkdtemp(prefix="tidal-lost-"))
    unblock = Unblocker(directory).start()
    unblock.record()
    res.stage("round 1")
    started = time.perf_counter()
    write_lost_notice(directory, round_=1, now=time.time() + 1)
    deadline = started + 10
    while True:  # what a blocked collective sees: the next one raises once aborted
        try:
            all_reduce_value("cuda")
        except Exception as exc:
            res.stage("collective raised", abort_s=time.perf_counter() - started,
                      error_type=type(exc).__name__, raised=str(exc)[:200])
            break
        if time.perf_counter() > deadline:
            res.stage("not aborted", error="no abort within 10 s of the lost notice")
            return
        time.sleep(0.005)
    unblock.handled()
    notice = notice_type(round=2, master_addr="127.0.0.1", master_port=args.port2,
                         world_size=1, ranks={0: 0}, written_at=time.time())
    reform = time.perf_counter()
    rank, world = rejoin(notice, local_rank=0)
    value = all_reduce_value("cuda")
    unblock.stop()
    res.stage("round 2", rejoin_and_all_reduce_s=time.perf_counter() - reform, rank=rank,
              world_size=world, value=value)


def _model(device: Any) -> tuple[Any, Any, Any]:
    import torch
    import torch.nn.functional as F

    from examples.charlm import SIZES, VOCAB, CharLM

    torch.manual_seed(1)
    model = CharLM(**SIZES["small"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (4, SIZES["small"]["block_size"]), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        optimizer.step()

    return model, optimizer, step


def _checksum(model: Any, optimizer: Any) -> list[float]:
    import torch

    with torch.no_grad():
        params = sum(float(p.double().sum()) for p in model.parameters())
        moments = sum(float(v.double().sum()) for s in optimizer.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return [params, moments]


def mode_transfer(res: Result, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rejoin, sync_state, notice_type = live_names()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, optimizer, step = _model(device)
    live_step = -1
    if args.rank == 0:
        init("gloo", args.port)  # round 1: alone
        for _ in range(3):
            step()
        live_step = 3
        res.stage("round 1")
        notice = notice_type(round=2, master_addr="127.0.0.1", master_port=args.port2,
                             world_size=2, ranks={0: 0}, written_at=time.time())
        started = time.perf_counter()
        rejoin(notice, local_rank=0)
    else:
        started = time.perf_counter()
        init("gloo", args.port2, rank=1, world_size=2)  # a joiner: straight into round 2
    joined = time.perf_counter() - started
    group = dist.new_group(backend="gloo")
    started = time.perf_counter()
    result = sync_state(live_step=live_step, group=group, model=model,
                        capture=lambda: {"optimizer": optimizer.state_dict(), "step": live_step})
    if result.state is not None:
        optimizer.load_state_dict(result.state["optimizer"])
    synced = time.perf_counter() - started
    devices = sorted({str(v.device) for s in optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0})
    mine = torch.tensor(_checksum(model, optimizer), dtype=torch.float64)
    both = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, mine, group=group)
    res.stage("synced", rank=args.rank, joined_s=joined, sync_s=synced, source=result.source,
              step=result.step, received=result.state is not None, state_devices=devices,
              checksums=[t.tolist() for t in both],
              equal=bool(torch.equal(both[0], both[1])), cuda_tensors=cuda)
    dist.destroy_process_group()


MODES = {"group": mode_group, "abort-live": mode_abort_live,
         "abort-dead-peer": mode_abort_dead_peer, "reform-nccl": mode_reform_nccl,
         "lost-nccl": mode_lost_nccl,
         "transfer": mode_transfer}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("result", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--port2", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="transfer: CPU tensors (dry run)")
    args = parser.parse_args()
    res = Result(args.result)
    try:
        MODES[args.mode](res, args)
    except Exception as exc:
        res.stage("error", error=f"{type(exc).__name__}: {exc}"[:500])
        sys.exit(1)


if __name__ == "__main__":
    main()
