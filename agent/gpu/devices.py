"""Which of the node's GPUs a job gets: a pure decision, and what the agent remembers of it.

The coordinator decides how many GPUs a job gets on a node
(``Assignment.gpus_per_node``); the agent decides which, with
:func:`plan_devices`:

* never a device another live job holds (a runner alive or still stopping
  holds its devices until it has exited), never one that failed;
* the devices the job had before on this node when they are free again (a
  restart, a resize's new generation, an agent restarted): its workers find
  their memory and caches where they left them, and ``tidal status`` does not
  shuffle;
* otherwise as few NVLink islands (or NUMA nodes, where NVML gives no
  NVLink) as possible: the smallest island that holds the whole request,
  lowest indices first; failing that, the largest islands first.

:class:`DeviceMemory` keeps each job's last devices in the agent's run
directory (``devices.json``) so that the preference survives an agent
restart; it is a hint, never a holding: holdings are the live runners'.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from rendezvous.gpus import GpuInfo

log = logging.getLogger(__name__)

#: The file under the agent's run directory that remembers the jobs' last devices.
MEMORY_FILE = "devices.json"
#: Jobs it remembers at most (the oldest are forgotten first).
MEMORY_LIMIT = 256

_MEMORY = TypeAdapter(dict[str, list[int]])


def _locality(gpu: GpuInfo) -> str:
    if gpu.island is not None:
        return f"island:{gpu.island}"
    if gpu.numa_node is not None:
        return f"numa:{gpu.numa_node}"
    return "node"


def plan_devices(
    gpus: Sequence[GpuInfo],
    held: Mapping[str, Collection[int]],
    job_id: str,
    count: int,
    previous: Sequence[int] = (),
) -> list[int] | None:
    """The device indices to give ``job_id``, or None if ``count`` are not free.

    Args:
        gpus: the node's GPUs, with their health.
        held: job id -> devices its live runner holds (``job_id``'s own, if
            there, are free to it again).
        job_id: the job to place.
        count: how many devices it asks for (0: none).
        previous: the devices it had last on this node, preferred.

    Returns:
        ``count`` sorted indices, healthy and held by no other job; None if
        there are not that many.
    """
    if count <= 0:
        return []
    taken = {i for other, devices in held.items() if other != job_id for i in devices}
    free = [g for g in sorted(gpus, key=lambda g: g.index) if g.healthy and g.index not in taken]
    if len(free) < count:
        return None
    by_index = {g.index: g for g in free}
    chosen = [i for i in dict.fromkeys(previous) if i in by_index][:count]
    groups: dict[str, list[int]] = {}
    for gpu in free:
        if gpu.index not in chosen:
            groups.setdefault(_locality(gpu), []).append(gpu.index)
    kept_groups = {_locality(by_index[i]) for i in chosen}
    while len(chosen) < count and groups:
        need = count - len(chosen)
        # The kept devices' islands first; then the smallest island holding the
        # rest; then the largest (fewest islands in all); lowest index breaks ties.
        name = min(groups, key=lambda k: (
            k not in kept_groups,
            len(groups[k]) < need,
            len(groups[k]) if len(groups[k]) >= need else -len(groups[k]),
            groups[k][0],
        ))
        taking = groups.pop(name)[:need]
        chosen += taking
        kept_groups.add(name)
    return sorted(chosen)


class DeviceMemory:
    """Each job's last devices on this node, kept in ``run_dir/devices.json``.

    Args:
        run_dir: the agent's run directory.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / MEMORY_FILE
        self._jobs: dict[str, list[int]] = self._load()

    def _load(self) -> dict[str, list[int]]:
        try:
            return _MEMORY.validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValidationError) as exc:
            log.warning("ignoring the unreadable %s: %s", self.path, exc)
            return {}

    def last(self, job_id: str) -> list[int]:
        """The devices ``job_id`` had last here ([] if none)."""
        return list(self._jobs.get(job_id, []))

    def remember(self, job_id: str, devices: Sequence[int]) -> None:
        """Record ``job_id``'s devices (written through a rename: never half-read)."""
        if self._jobs.get(job_id) == list(devices):
            return
        self._jobs.pop(job_id, None)
        self._jobs[job_id] = list(devices)
        while len(self._jobs) > MEMORY_LIMIT:
            del self._jobs[next(iter(self._jobs))]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(self._jobs, f)
            os.replace(tmp, self.path)
        except OSError as exc:  # a preference only: the job runs anyway
            log.warning("cannot remember the devices of %s in %s: %s", job_id, self.path, exc)


def failed_devices(gpus: Sequence[GpuInfo], held: Mapping[str, Collection[int]]) -> dict[str, str]:
    """The jobs that hold a failed GPU, each with why ("GPU 2 failed: XID 79 ...")."""
    faults = {g.index: g.fault or "failed" for g in gpus if not g.healthy}
    out: dict[str, str] = {}
    for job_id, devices in held.items():
        bad = sorted(i for i in devices if i in faults)
        if bad:
            out[job_id] = "; ".join(f"GPU {i} failed: {faults[i]}" for i in bad)
    return out
