"""The etcd part of every tidal process's settings (pydantic-settings, ``TIDAL_`` prefix).

The agent and the coordinator each have one settings class (flags >
``TIDAL_*`` environment > defaults); both reach etcd the same way, so the
fields that say how live here, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode

from rendezvous.client import EtcdConfig
from rendezvous.keys import DEFAULT_ROOT


class EtcdSettings(BaseSettings):
    """How a process reaches etcd: ``TIDAL_ETCD_ENDPOINTS`` (comma-separated or
    JSON), ``TIDAL_ETCD_ROOT``, ``TIDAL_ETCD_TIMEOUT_S``, TLS files, user and password."""

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
