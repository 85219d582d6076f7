"""The node's GPUs: what there is, whether it is healthy, how busy it is.

An inventory (:class:`GpuInventory`) answers :meth:`~GpuInventory.poll` with a
:class:`GpuSnapshot`: each GPU's record (:class:`rendezvous.gpus.GpuInfo`,
published in the node record) and its readings (:class:`GpuReading`,
exported as metrics only: they change every second and have no place in
etcd). Three implementations:

* :class:`NvmlInventory`, the real one, through NVML (``nvidia-ml-py``).
  NVML talks to the driver only: the agent never creates a CUDA context.
  Health: a GPU that NVML says is lost (fell off the bus), that has
  uncorrectable ECC errors since the driver loaded, or that reported a
  critical XID since the agent started, is failed, and stays failed until
  the agent restarts;
* :class:`FileInventory` reads the same facts from a JSON file
  (``TIDAL_GPU_INVENTORY_FILE``), re-read at every poll: how tests, and
  machines whose driver NVML cannot read, describe GPUs and break them;
* :class:`StaticInventory`: explicit indices (``--gpus 0,1,3``) on a
  machine without NVML, always healthy, no readings.

:func:`open_inventory` picks one from the agent's settings.
:class:`GpuMonitor` polls it on a thread with a deadline (an NVML call can
block on a sick GPU; the agent's loop never waits on one) and keeps the last
snapshot for the daemon and the metrics.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rendezvous.gpus import MAX_GPUS, GpuInfo, check_indices

log = logging.getLogger(__name__)

T = TypeVar("T")

#: XIDs that mean the GPU itself is broken (not the program on it): double-bit
#: ECC, GPU hung or stopped processing, row remapping failure, NVLink error,
#: fell off the bus, uncontained ECC, GSP firmware errors. NVIDIA's XID catalogue.
FATAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


class GpuReading(BaseModel):
    """What a GPU is doing now (None where NVML does not say)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    memory_used_bytes: int | None = Field(default=None, ge=0)
    power_w: float | None = Field(default=None, ge=0)
    temperature_c: float | None = None


@dataclass(frozen=True)
class GpuSnapshot:
    """One poll of the inventory."""

    gpus: tuple[GpuInfo, ...] = ()
    readings: dict[int, GpuReading] = field(default_factory=dict)  # by index


class GpuInventory(Protocol):
    """Where the agent learns its GPUs. ``poll`` may block (a sick GPU); call it
    through :class:`GpuMonitor` or :func:`call_with_deadline`."""

    def poll(self) -> GpuSnapshot:
        """Every GPU with its health and readings.

        Raises:
            GpuInventoryError: the inventory cannot be read at all.
        """
        ...

    def close(self) -> None:
        """Release what the inventory holds (NVML's handle)."""
        ...


class GpuInventoryError(RuntimeError):
    """The GPUs cannot be listed (NVML missing or failing, a bad inventory file)."""


# selection -------------------------------------------------------------------------


def parse_selection(text: str) -> list[int] | None:
    """``--gpus``: "all" -> None (every GPU found), "none" -> [], "0,1,3" -> [0, 1, 3].

    Raises:
        ValueError: naming what is wrong.
    """
    value = text.strip().lower()
    if value == "all":
        return None
    if value in ("none", ""):
        return []
    indices: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= MAX_GPUS:
            raise ValueError(
                f"--gpus {text!r}: use all, none or GPU indices such as 0,1,3 (each below "
                f"{MAX_GPUS})"
            )
        if int(part) in indices:
            raise ValueError(f"--gpus {text!r}: GPU {int(part)} is given twice")
        indices.append(int(part))
    return sorted(indices)


def select(snapshot: GpuSnapshot, chosen: Sequence[int] | None) -> GpuSnapshot:
    """The part of ``snapshot`` the agent offers: every GPU, or ``chosen`` ones.

    Where the inventory lists no GPU at all (no NVML), a chosen index is
    offered as a bare, healthy GPU: explicit indices work without NVML.

    Raises:
        GpuInventoryError: an index the inventory does not list, where it lists
            some (``--gpus 8`` on a machine with GPUs 0-7).
    """
    if chosen is None:
        return snapshot
    known = {g.index: g for g in snapshot.gpus}
    unknown = [i for i in chosen if i not in known]
    if known and unknown:
        raise GpuInventoryError(
            f"--gpus names GPU(s) {', '.join(map(str, unknown))}, which this machine does not "
            f"have (it has {', '.join(map(str, sorted(known)))}); --gpus takes indices, not a "
            "count"
        )
    gpus = tuple(known.get(i) or GpuInfo(index=i) for i in chosen)
    readings = {i: r for i, r in snapshot.readings.items() if i in chosen}
    return GpuSnapshot(gpus, readings)


# implementations -----------------------------------------------------------------


class StaticInventory:
    """Explicit GPU indices, healthy for ever, with no readings."""

    def __init__(self, indices: Sequence[int]) -> None:
        self._snapshot = GpuSnapshot(tuple(GpuInfo(index=i) for i in indices))

    def poll(self) -> GpuSnapshot:
        return self._snapshot

    def close(self) -> None:
        pass


class FileGpu(GpuInfo, GpuReading):
    """One GPU in an inventory file: its record and its readings."""


class InventoryFile(BaseModel):
    """The JSON of :class:`FileInventory`: ``{"gpus": [{"index": 0, ...}, ...]}``."""

    model_config = ConfigDict(extra="forbid")

    gpus: list[FileGpu] = Field(default_factory=list, max_length=MAX_GPUS)


_FILE = TypeAdapter(InventoryFile)
_INFO_FIELDS = set(GpuInfo.model_fields)
_READING_FIELDS = set(GpuReading.model_fields)


class FileInventory:
    """GPUs described by a JSON file, read again at every poll.

    Args:
        path: the file (:class:`InventoryFile`).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def poll(self) -> GpuSnapshot:
        try:
            parsed = _FILE.validate_json(self.path.read_bytes())
            check_indices(parsed.gpus)
        except (OSError, ValidationError, ValueError) as exc:
            raise GpuInventoryError(f"cannot read the GPU inventory {self.path}: {exc}") from exc
        gpus = tuple(GpuInfo(**g.model_dump(include=_INFO_FIELDS)) for g in parsed.gpus)
        readings = {
            g.index: GpuReading(**g.model_dump(include=_READING_FIELDS)) for g in parsed.gpus
        }
        return GpuSnapshot(gpus, readings)

    def close(self) -> None:
        pass


class NvmlInventory:
    """The GPUs NVML sees (``nvidia-ml-py``); never a CUDA context.

    Raises:
        GpuInventoryError: NVML cannot be loaded or initialised (no driver).
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise GpuInventoryError("NVML is not installed (pip install nvidia-ml-py)") from exc
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuInventoryError(f"NVML cannot start: {exc}") from exc
        self._faults: dict[int, str] = {}  # sticky until the agent restarts
        self._static: dict[int, GpuInfo] = {}
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.info("NVML gives no XID events here (%s): health from ECC and loss only", exc)
        count = pynvml.nvmlDeviceGetCount()
        islands = self._islands(count)
        for index in range(count):
            try:
                self._static[index] = self._describe(index, islands.get(index))
            except pynvml.NVMLError as exc:
                self._faults[index] = f"NVML cannot read it: {exc}"
                self._static[index] = GpuInfo(index=index)

    # the static facts, once ------------------------------------------------------

    def _describe(self, index: int, island: str | None) -> GpuInfo:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        if self._events is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._events
                )
        return GpuInfo(
            index=index, uuid=uuid, model=_text(nvml.nvmlDeviceGetName(handle))[:96],
            memory_bytes=memory, numa_node=self._numa(handle), island=island,
        )

    def _numa(self, handle: Any) -> int | None:
        nvml = self._nvml
        try:
            bus = _text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
        except nvml.NVMLError:
            return None
        # NVML's bus id has 8 domain digits; sysfs 4.
        domain, _, rest = bus.partition(":")
        path = Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}" / "numa_node"
        try:
            node = int(path.read_text().strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    def _islands(self, count: int) -> dict[int, str]:
        """GPUs joined by active NVLinks, as connected components named by their lowest index."""
        nvml = self._nvml
        bus_to_index: dict[str, int] = {}
        links: dict[int, set[str]] = {}
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                bus_to_index[_text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower()] = index
            except nvml.NVMLError:
                continue
            peers: set[str] = set()
            for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
                except nvml.NVMLError:
                    break  # no NVLink, or no more links
                peers.add(_text(remote.busId).lower())
            links[index] = peers
        if not any(links.values()):
            return {}
        switch = count  # every GPU linked to an NVSwitch (a peer that is no GPU) is one island
        parent = list(range(count + 1))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for index, peers in links.items():
            for bus in peers:
                a, b = root(index), root(bus_to_index.get(bus, switch))
                parent[max(a, b)] = min(a, b)  # the lowest GPU index names the island
        return {i: str(root(i)) for i in range(count)}

    # each poll -------------------------------------------------------------------

    def poll(self) -> GpuSnapshot:
        self._drain_xids()
        gpus: list[GpuInfo] = []
        readings: dict[int, GpuReading] = {}
        for index, info in sorted(self._static.items()):
            fault = self._faults.get(index) or self._check(index)
            if fault:
                self._faults[index] = fault
                gpus.append(info.model_copy(update={"healthy": False, "fault": fault[:256]}))
                continue
            gpus.append(info)
            readings[index] = self._read(index)
        return GpuSnapshot(tuple(gpus), readings)

    def _drain_xids(self) -> None:
        nvml = self._nvml
        if self._events is None:
            return
        uuids = {g.uuid: i for i, g in self._static.items()}
        while True:
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing more pending
            xid = int(event.eventData)
            if xid not in FATAL_XIDS:
                log.info("GPU XID %d (not a hardware fault) reported", xid)
                continue
            try:
                index = uuids.get(_text(nvml.nvmlDeviceGetUUID(event.device)))
            except nvml.NVMLError:
                index = None
            if index is not None:
                self._faults.setdefault(index, f"XID {xid} reported by the driver")

    def _check(self, index: int) -> str:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceGetUUID(handle)
        except nvml.NVMLError as exc:
            if isinstance(exc, getattr(nvml, "NVMLError_GpuIsLost", ())):
                return "lost: the GPU fell off the bus"
            return f"NVML cannot reach it: {exc}"
        try:
            errors = nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            )
        except nvml.NVMLError:
            return ""  # no ECC on this model
        return f"{errors} uncorrectable ECC error(s)" if errors else ""

    def _read(self, index: int) -> GpuReading:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        values: dict[str, float | int] = {}
        reads: dict[str, Callable[[], float | int]] = {
            "utilization_pct": lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "memory_used_bytes": lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "temperature_c": lambda: float(
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            ),
        }
        for name, read in reads.items():
            with contextlib.suppress(nvml.NVMLError):
                values[name] = read()
        return GpuReading.model_validate(values)

    def close(self) -> None:
        nvml = self._nvml
        with contextlib.suppress(nvml.NVMLError):
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
            nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def open_inventory(
    selection: Sequence[int] | None, inventory_file: Path | None
) -> GpuInventory:
    """The agent's inventory: the file if one is given, else NVML, else explicit indices.

    Args:
        selection: ``--gpus`` parsed (:func:`parse_selection`): None for all.
        inventory_file: ``TIDAL_GPU_INVENTORY_FILE``, if set.

    Returns:
        The inventory; a :class:`StaticInventory` of no GPUs when there is no
        NVML and no indices were given.
    """
    if inventory_file is not None:
        return FileInventory(inventory_file)
    if selection == []:
        return StaticInventory([])
    try:
        return NvmlInventory()
    except GpuInventoryError as exc:
        if selection:
            log.info("%s; offering the GPUs given: %s", exc, ",".join(map(str, selection)))
        else:
            log.info("%s; no GPUs offered", exc)
        return StaticInventory(selection or [])


class DeadlineError(TimeoutError):
    """A call did not return within its deadline (it goes on, abandoned, on its thread)."""


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` on a daemon thread, waited for at most ``timeout_s``.

    Raises:
        DeadlineError: it did not return in time.
        Exception: whatever ``fn`` raised.
    """
    box: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise DeadlineError(f"{what} did not answer within {timeout_s:.0f} s")
    if error:
        raise error[0]
    return box[0]


class GpuMonitor:
    """Polls an inventory every ``interval_s`` on its own thread; keeps the last snapshot.

    Args:
        inventory: where the GPUs come from.
        selection: the GPUs offered (:func:`parse_selection`; None for all).
        interval_s: seconds between polls.
        on_change: called (on the monitor's thread) when the GPUs' records change.
        timeout_s: how long a poll may take before the monitor says so.
    """

    def __init__(
        self,
        inventory: GpuInventory,
        selection: Sequence[int] | None,
        *,
        interval_s: float = 2.0,
        on_change: Callable[[], None] = lambda: None,
        timeout_s: float = 30.0,
    ) -> None:
        self._inventory = inventory
        self._selection = selection
        self._interval = interval_s
        self._on_change = on_change
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._snapshot = GpuSnapshot()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def snapshot(self) -> GpuSnapshot:
        """The last poll (the first is taken by :meth:`start`)."""
        with self._lock:
            return self._snapshot

    def start(self) -> GpuMonitor:
        """Poll once (with a deadline), then keep polling on a thread.

        Raises:
            GpuInventoryError, DeadlineError: the first poll failed: the agent
                cannot know its GPUs.
        """
        first = call_with_deadline(self._inventory.poll, self._timeout, "the first GPU poll")
        self._snapshot = select(first, self._selection)
        self._thread = threading.Thread(target=self._loop, name="gpu monitor", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            started = time.monotonic()
            try:
                polled = select(self._inventory.poll(), self._selection)
            except GpuInventoryError as exc:
                log.warning("%s (keeping the last GPU records)", exc)
                continue
            except Exception:
                log.exception("the GPU poll failed (keeping the last GPU records)")
                continue
            took = time.monotonic() - started
            if took > self._timeout:
                log.warning("the GPU poll took %.0f s: a GPU may be hung", took)
            with self._lock:
                changed = polled.gpus != self._snapshot.gpus
                self._snapshot = polled
            if changed:
                self._on_change()

    def stop(self) -> None:
        """Stop polling and close the inventory (a poll blocked in NVML is abandoned)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=1.0)
            if thread.is_alive():
                log.warning("the GPU poll is blocked; leaving it")
                return
        self._inventory.close()
