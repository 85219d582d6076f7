"""Re-forming the process group on the live path: leave the old group, join the new round's.

:func:`rejoin` destroys this process's groups and initializes the default
group the runner's notice describes, with the old group's backend and timeout
(:func:`group_timeout`). The caller (the checkpointer) has drained every
collective in flight; the state sync that follows is
:mod:`checkpoints.live.sync`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from checkpoints.errors import LiveResizeError
from checkpoints.protocol.live import ResizeNotice

__all__ = ["RoundStore", "group_timeout", "rejoin"]

log = logging.getLogger("checkpoints.live")  # the name it always logged under

#: The new group's timeout when the old one's cannot be read.
_DEFAULT_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def group_timeout() -> datetime.timedelta:
    """The default group's timeout (the script's choice), to give the new group the same."""
    with contextlib.suppress(Exception):  # private API: any failure means "unknown"
        group = dist.distributed_c10d._get_default_group()
        for device in group._device_types:
            timeout = group._get_backend(device).options._timeout
            if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
                return timeout
    return _DEFAULT_GROUP_TIMEOUT


#: The prefix ``init_process_group`` gives the default group's keys in a store it made
#: from ``env://`` or ``tcp://`` (a joiner's); a store handed to it gets none of its own.
_DEFAULT_PG_PREFIX = "default_pg"


class RoundStore:
    """The new group's store, opened by its rank 0 before the old group stops.

    A growing group's rank 0 opens the store of the notice's round as soon as it
    sees the notice, while it trains on in the old group: a joiner's
    ``init_process_group`` then connects at its first try (torch's client retries a
    port that does not listen yet with a back-off of up to a second) and waits there,
    and rank 0 sees it waiting (:meth:`joiners_waiting`) before the old group stops.
    :func:`rejoin` hands it to ``init_process_group``.

    Raises:
        RuntimeError, OSError: when the port cannot be bound (``open``).
    """

    def __init__(self, notice: ResizeNotice, store: TCPStore) -> None:
        self.round, self.port = notice.round, notice.master_port
        self.store = store

    @classmethod
    def open(cls, notice: ResizeNotice) -> RoundStore:
        """Listen on the notice's port (every interface, as ``init_process_group`` would)."""
        store = TCPStore(
            notice.master_addr, notice.master_port, is_master=True, wait_for_workers=False,
            timeout=group_timeout(), multi_tenant=True,
        )
        return cls(notice, store)

    def joiners_waiting(self, joiners: int) -> bool:
        """Whether ``joiners`` ranks wait in the store: a rank that waits in gloo's
        connection of the default group has put its address key (torch 2.13: one key
        each, and one shared; counting keys says "at least as many ranks", never "fewer
        than there are": a store with too few keys only delays the re-form, bounded)."""
        return int(self.store.num_keys()) >= joiners

    def fits(self, notice: ResizeNotice) -> bool:
        return (self.round, self.port) == (notice.round, notice.master_port)


def rejoin(notice: ResizeNotice, *, local_rank: int,
           store: RoundStore | None = None) -> tuple[int, int]:
    """Leave the current process group and join the one ``notice`` describes.

    Destroys every process group of this process (the default one and the
    subgroups), initializes the new default group with the same backend and
    timeout, and exports the new RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    (and GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE) for code
    that reads the environment later. The caller must have drained every
    collective in flight. ``store``: the round's store, opened early by this
    rank (its rank 0); it is used if it is the notice's.

    Returns:
        (new rank, new world size).

    Raises:
        LiveResizeError: when the notice has no rank for ``local_rank``.
        RuntimeError, DistError: when the new group does not form in time.
    """
    rank = notice.ranks.get(local_rank)
    if rank is None:
        raise LiveResizeError(
            f"the round {notice.round} notice gives local rank {local_rank} no rank "
            f"(it names {sorted(notice.ranks)})"
        )
    backend = dist.get_backend()
    timeout = group_timeout()
    dist.destroy_process_group()
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(notice.world_size),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(notice.world_size),
        "MASTER_ADDR": notice.master_addr,
        "MASTER_PORT": str(notice.master_port),
    }
    if notice.group_rank is not None:
        env["GROUP_RANK"] = str(notice.group_rank)
    if notice.group_world_size is not None:
        env["GROUP_WORLD_SIZE"] = str(notice.group_world_size)
    os.environ.update(env)
    started = time.monotonic()
    if rank == 0 and store is not None and store.fits(notice):
        dist.init_process_group(
            backend=backend, store=PrefixStore(_DEFAULT_PG_PREFIX, store.store),
            rank=rank, world_size=notice.world_size, timeout=timeout,
        )
    else:
        if rank != 0:
            wait_for_listener(notice.master_addr, notice.master_port,
                              timeout_s=timeout.total_seconds())
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{_host(notice.master_addr)}:{notice.master_port}",
            rank=rank,
            world_size=notice.world_size,
            timeout=timeout,
        )
    log.info(
        "joined round %d as rank %d of %d in %.2f s",
        notice.round, rank, notice.world_size, time.monotonic() - started,
    )
    return rank, notice.world_size


#: How often a non-zero rank tries the new round's store port before it listens.
LISTENER_POLL_S = 0.005


def wait_for_listener(addr: str, port: int, *, timeout_s: float) -> bool:
    """Wait until ``addr:port`` accepts a connection (the new round's store, which its
    rank 0 opens); False after ``timeout_s``.

    ``init_process_group`` over ``tcp://`` connects the non-zero ranks to a store that
    rank 0 may not have opened yet, and torch's client then retries with an exponential
    back-off of about a second: that, not the protocol, was most of a re-form (0.3 to
    0.7 s where rank 0 came a few milliseconds late). A plain connect every few
    milliseconds finds the store as soon as it listens; ``init_process_group`` then
    connects at its first try. The probe connection closes without a byte.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LISTENER_POLL_S)


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
