"""Configuration of one `tidal agent` process: flags > TIDAL_* environment > defaults."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from rendezvous.client import EtcdConfig
from rendezvous.keys import DEFAULT_ROOT, validate_id


def _default_node_id() -> str:
    name = socket.gethostname().split(".")[0]
    try:
        return validate_id(name, what="node id")
    except ValueError:
        return "node"


class AgentSettings(BaseSettings):
    """Everything `tidal agent` can be told.

    Environment variables are the field names upper-cased with ``TIDAL_``
    (``TIDAL_NODE_ID``, ``TIDAL_ETCD_ENDPOINTS`` as JSON or comma-separated, ...).
    """

    model_config = SettingsConfigDict(env_prefix="TIDAL_", extra="forbid")

    etcd_endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:2379"]
    )
    etcd_root: str = DEFAULT_ROOT
    etcd_timeout_s: float = Field(default=5.0, gt=0, le=300)
    etcd_ca_cert: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    etcd_user: str | None = None
    etcd_password: SecretStr | None = None

    node_id: str = Field(default_factory=_default_node_id)
    address: str = Field(default="127.0.0.1", min_length=1, max_length=253)
    slots: int = Field(default=1, ge=1, le=1024)
    gpus: int = Field(default=0, ge=0, le=1024)
    labels: dict[str, str] = Field(default_factory=dict)
    run_dir: Path = Path(".tidal/agent")
    lease_ttl_s: int = Field(default=5, ge=2, le=300)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    stop_grace_s: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str) -> str:
        return validate_id(value, what="node id")

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _split_endpoints(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def etcd_config(self) -> EtcdConfig:
        return EtcdConfig(
            endpoints=self.etcd_endpoints,
            timeout_s=self.etcd_timeout_s,
            root=self.etcd_root,
            ca_cert=self.etcd_ca_cert,
            cert_cert=self.etcd_cert,
            cert_key=self.etcd_key,
            user=self.etcd_user,
            password=self.etcd_password,
        )
