"""A local Prometheus for `tidal up --prometheus`, scraping the coordinator and the agents.

:func:`render_config` builds the same scrape configuration as
deploy/prometheus/prometheus.yml (scrape jobs ``tidal-coordinator`` and
``tidal-agent``, the alerting rules of deploy/prometheus/tidal-alerts.yml),
with the local cluster's addresses: the coordinator as a static target, the
agents in a file_sd targets file that :class:`LocalPrometheus` rewrites when
agents come (Prometheus re-reads it on change). A target, once added, stays,
as a static target would: a dead node's agent shows ``up == 0``.

The configuration is written as JSON, which is YAML too: no YAML library needed.
Prometheus is the ``prometheus`` binary on PATH (Debian's package); it runs in a
process group of its own, with its data under ``STATE/prometheus/``, and is
stopped with the cluster. Like the rest of the service, this module never
imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from rendezvous.child import Child
from rendezvous.etcd.server import free_port

log = logging.getLogger(__name__)

COORDINATOR_JOB = "tidal-coordinator"
AGENT_JOB = "tidal-agent"
DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES_FILE = DEPLOY_DIR / "tidal-alerts.yml"
START_ATTEMPTS = 3


class PrometheusError(Exception):
    """Prometheus is missing, or did not start or become ready."""


def find_prometheus(binary: str | os.PathLike[str] | None = None) -> Path:
    """The Prometheus binary: ``binary`` if given, else ``prometheus`` on PATH.

    Raises:
        PrometheusError: there is none.
    """
    found = shutil.which(str(binary or "prometheus"))
    if found is None:
        raise PrometheusError(
            f"{binary or 'prometheus'} is not on PATH: install Debian's prometheus package "
            "(bash .ci/system-deps.sh) or run without --prometheus"
        )
    return Path(found)


def target_of(url: str) -> str:
    """``host:port`` of a base URL (``http://127.0.0.1:8470`` -> ``127.0.0.1:8470``)."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"URL {url!r} has no host and port")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def render_config(
    *,
    coordinator: str,
    agents_file: Path,
    scrape_interval_s: float = 5.0,
    rule_files: Iterable[Path] = (),
) -> str:
    """A Prometheus configuration (JSON, valid YAML) for one tidal cluster.

    Args:
        coordinator: the coordinator's ``host:port``.
        agents_file: a file_sd targets file listing the agents' metrics ``host:port``.
        scrape_interval_s: how often to scrape and evaluate rules.
        rule_files: alerting and recording rule files to load.
    """
    interval = f"{scrape_interval_s:g}s"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "scrape_timeout": f"{min(scrape_interval_s, 10.0):g}s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {"job_name": COORDINATOR_JOB, "static_configs": [{"targets": [coordinator]}]},
            {"job_name": AGENT_JOB,
             "file_sd_configs": [{"files": [str(agents_file)], "refresh_interval": "5s"}]},
        ],
    }
    return json.dumps(config, indent=2) + "\n"


def write_targets(path: Path, targets: Iterable[str]) -> None:
    """Write a file_sd targets file atomically (Prometheus never reads half of it)."""
    body = [{"targets": sorted(set(targets)), "labels": {}}]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, path)


class LocalPrometheus:
    """One Prometheus scraping a local cluster. :meth:`start`, then :meth:`stop`.

    Args:
        directory: its configuration, targets file and data (``data/``) go here.
        log_path: its output.
        binary: the Prometheus binary (default: ``prometheus`` on PATH).
        scrape_interval_s: how often it scrapes.
        ready_timeout_s: how long :meth:`start` waits for ``/-/ready``.
        rules: rule files to load (default: deploy/prometheus/tidal-alerts.yml if present).
    """

    def __init__(
        self,
        *,
        directory: Path,
        log_path: Path,
        binary: str | os.PathLike[str] | None = None,
        scrape_interval_s: float = 5.0,
        ready_timeout_s: float = 30.0,
        rules: Iterable[Path] | None = None,
        parent_death_signal: signal.Signals | None = None,
    ) -> None:
        self.binary = find_prometheus(binary)
        # Sent to Prometheus when the thread that starts it exits (rendezvous.child).
        self.parent_death_signal = parent_death_signal
        self.directory = directory
        self.log_path = log_path
        self.scrape_interval_s = scrape_interval_s
        self.ready_timeout_s = ready_timeout_s
        self.rules = list(rules) if rules is not None else [p for p in [RULES_FILE] if p.exists()]
        self.config_path = directory / "prometheus.yml"
        self.targets_path = directory / "agents.json"
        self._child: Child | None = None
        self.url: str | None = None
        self._agents: set[str] = set()

    def start(self, *, coordinator: str, agents: Iterable[str]) -> str:
        """Configure, start and wait until ready; returns its URL.

        Args:
            coordinator: the coordinator's ``host:port``.
            agents: the agents' metrics ``host:port``.

        Raises:
            PrometheusError: it exited or was not ready in time (with its log tail);
                nothing of it is left running.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self.add_agents(agents)
        self.config_path.write_text(render_config(
            coordinator=coordinator, agents_file=self.targets_path,
            scrape_interval_s=self.scrape_interval_s, rule_files=self.rules,
        ))
        for attempt in range(1, START_ATTEMPTS + 1):
            port = free_port()
            try:
                self.url = self._start_on(port)
                return self.url
            except PrometheusError as exc:
                if attempt == START_ATTEMPTS or "address already in use" not in str(exc):
                    raise
                log.info("port %d was taken before Prometheus bound it; trying another", port)
        raise AssertionError("unreachable")

    def add_agents(self, agents: Iterable[str]) -> None:
        """Scrape these agents too (targets are kept: a dead agent shows ``up == 0``)."""
        new = set(agents) - self._agents
        if new or not self.targets_path.exists():
            self._agents |= new
            self.directory.mkdir(parents=True, exist_ok=True)
            write_targets(self.targets_path, self._agents)

    def _start_on(self, port: int) -> str:
        argv = [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=7d",
            "--web.enable-lifecycle",
        ]
        child = self._child = Child.spawn("prometheus", argv, self.log_path,
                                          parent_death_signal=self.parent_death_signal)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = child.poll()
            if code is not None:
                self._child = None
                raise PrometheusError(
                    f"prometheus exited with code {code} while starting on port {port}:\n"
                    f"{child.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    log.info("prometheus at %s (pid %d)", url, child.pid)
                    return url
            if time.monotonic() > deadline:
                tail = child.log_tail()
                self.stop()
                raise PrometheusError(
                    f"prometheus was not ready within {self.ready_timeout_s:g} s:\n{tail}"
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM its process group, SIGKILL after ``timeout_s``; idempotent."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(timeout_s)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child else None
