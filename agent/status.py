"""Report what this node does for a job into etcd, on change and at most ~1/s.

The job runner calls :meth:`StatusReporter.update` at every transition
(starting, running, restarting, ...) and a background thread folds in the
workers' progress (step, last checkpoint) from the status files the
checkpoints library writes into ``TIDAL_PROGRESS_DIR``. A write happens only
when something changed, and no more often than ``min_interval_s``; terminal
states are written at once. The coordinator reads ``status/<job>/<node>``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from rendezvous.client import EtcdClient
from rendezvous.errors import EtcdError
from rendezvous.records import JobNodeState, JobNodeStatus, utcnow

log = logging.getLogger(__name__)


def read_progress(progress_dir: Path) -> dict[str, int | None]:
    """The newest step and checkpoint step over every rank's progress file.

    Files that are missing, half-written or not JSON are skipped: the workers
    write them atomically, but a rank may not have written one yet.
    """
    step: int | None = None
    ckpt: int | None = None
    for path in progress_dir.glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data.get("step"), int):
            step = max(step or 0, data["step"])
        last = data.get("last_checkpoint_step")
        if isinstance(last, int):
            ckpt = max(ckpt or 0, last)
    return {"last_step": step, "last_checkpoint_step": ckpt}


class StatusReporter:
    """Writes one :class:`JobNodeStatus` record, throttled, from a thread.

    Args:
        client: the runner's etcd client.
        status: the initial record (job, node, generation, state).
        progress_dir: where the workers' progress files are, if any.
        min_interval_s: least time between two writes of non-terminal states.
    """

    def __init__(
        self,
        client: EtcdClient,
        status: JobNodeStatus,
        *,
        progress_dir: Path | None = None,
        min_interval_s: float = 1.0,
    ) -> None:
        self._client = client
        self._key = client.keys.status(status.job_id, status.node_id)
        self._status = status
        self._progress_dir = progress_dir
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._written: dict[str, Any] | None = None
        self._last_write = 0.0
        self._thread = threading.Thread(target=self._run, name="status reporter", daemon=True)

    @property
    def status(self) -> JobNodeStatus:
        with self._lock:
            return self._status.model_copy()

    def start(self) -> StatusReporter:
        self._write()
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        """Change fields of the record; terminal states are written before returning."""
        with self._lock:
            self._status = self._status.model_copy(update=fields)
            terminal = self._status.state.is_terminal()
        if terminal:
            self._write()
        else:
            self._dirty.set()

    def count_restart(self, reason: str) -> None:
        with self._lock:
            reasons = dict(self._status.restart_reasons)
            reasons[reason] = reasons.get(reason, 0) + 1
            self._status = self._status.model_copy(
                update={
                    "restart_reasons": reasons,
                    "restart_count": self._status.restart_count + 1,
                    "last_restart_reason": reason,
                    "state": JobNodeState.RESTARTING,
                }
            )
        self._dirty.set()

    def close(self) -> None:
        """Write what is pending and stop the thread."""
        self._stop.set()
        self._dirty.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._client.config.timeout_s + 2)
        self._write()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(timeout=self._min_interval_s)
            if self._stop.is_set():
                return
            wait = self._min_interval_s - (time.monotonic() - self._last_write)
            if wait > 0 and self._stop.wait(wait):
                return
            self._dirty.clear()
            if self._progress_dir is not None:
                progress = read_progress(self._progress_dir)
                with self._lock:
                    changed = {k: v for k, v in progress.items() if v is not None}
                    self._status = self._status.model_copy(update=changed)
            self._write()

    def _write(self) -> None:
        with self._lock:
            comparable = self._status.model_dump(mode="json", exclude={"updated_at"})
            if comparable == self._written:
                return
            self._status = self._status.model_copy(update={"updated_at": utcnow()})
            payload = self._status.model_dump_json().encode()
        try:
            self._client.put(self._key, payload)
        except EtcdError as exc:
            log.warning("could not write the status of %s: %s", self._key, exc)
            self._dirty.set()
            return
        with self._lock:
            self._written = comparable
            self._last_write = time.monotonic()
