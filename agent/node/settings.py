"""Configuration of one `tidal agent` process: flags > TIDAL_* environment > defaults."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from agent.gpu.nvml import parse_selection
from agent.workers.logcap import DEFAULT_MAX_BYTES
from agent.workers.user import check_setting
from rendezvous.etcd.settings import EtcdSettings
from rendezvous.keys import validate_id


def _default_node_id() -> str:
    name = socket.gethostname().split(".")[0]
    try:
        return validate_id(name, what="node id")
    except ValueError:
        return "node"


class AgentSettings(EtcdSettings):
    """Everything `tidal agent` can be told.

    Environment variables are the field names upper-cased with ``TIDAL_``
    (``TIDAL_NODE_ID``, ``TIDAL_ETCD_ENDPOINTS`` as JSON or comma-separated, ...).
    """

    model_config = SettingsConfigDict(env_prefix="TIDAL_", extra="forbid")

    node_id: str = Field(default_factory=_default_node_id)
    address: str = Field(default="127.0.0.1", min_length=1, max_length=253)
    slots: int = Field(default=1, ge=1, le=1024)
    # "all" (what NVML finds), "none", or indices "0,1,3" (accepted without NVML).
    gpus: str = Field(default="all", max_length=4096)
    # A JSON file that stands for NVML (agent.gpu.nvml.FileInventory): tests, odd drivers.
    gpu_inventory_file: Path | None = None
    # Seconds between GPU health and utilisation polls.
    gpu_poll_s: float = Field(default=2.0, gt=0, le=300)
    labels: dict[str, str] = Field(default_factory=dict)
    run_dir: Path = Path(".tidal/agent")
    lease_ttl_s: int = Field(default=5, ge=2, le=300)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # All interfaces by default, for a Prometheus on another machine; `tidal up`
    # passes 127.0.0.1 (its Prometheus, if any, runs on this machine).
    metrics_host: str = Field(default="0.0.0.0", min_length=1, max_length=253)
    # The jobs' logs are served to the coordinator on this port (0: any free one),
    # on metrics_host, behind a token in the node's record (agent.node.logserve).
    logs_port: int = Field(default=0, ge=0, le=65535)
    stop_grace_s: float = Field(default=30.0, gt=0, le=3600)
    log_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1024)
    # Keep a runner (and its zygote) started ahead of the next job; see agent.node.daemon.
    warm_runner: bool = True
    # Run the jobs' workers as this user (the agent must be root); see agent.workers.user.
    worker_user: str | None = Field(default=None, min_length=1, max_length=64)

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str) -> str:
        return validate_id(value, what="node id")

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: str) -> str:
        parse_selection(value)
        return value

    @property
    def gpu_selection(self) -> list[int] | None:
        """``gpus`` parsed: None for all, [] for none, else the indices."""
        return parse_selection(self.gpus)

    @field_validator("worker_user")
    @classmethod
    def _worker_user(cls, value: str | None) -> str | None:
        return check_setting(value, euid=os.geteuid())
