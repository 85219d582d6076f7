"""How to reach etcd: :class:`EtcdConfig`, built once per process from its settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from rendezvous.keys import DEFAULT_ROOT, validate_root


class EtcdConfig(BaseModel):
    """How to reach etcd. Built once per process from its settings.

    Attributes:
        endpoints: ``host:port`` or ``http(s)://host:port`` strings.
        timeout_s: deadline of every single etcd call, in seconds.
        root: key prefix every tidal key lives under.
        ca_cert: CA bundle; setting it switches to TLS.
        cert_cert / cert_key: client certificate and key (both or neither).
        user / password: etcd authentication (both or neither).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoints: list[str] = Field(default_factory=lambda: ["127.0.0.1:2379"], min_length=1)
    timeout_s: float = Field(default=5.0, gt=0, le=300)
    root: str = DEFAULT_ROOT
    ca_cert: Path | None = None
    cert_cert: Path | None = None
    cert_key: Path | None = None
    user: str | None = None
    password: SecretStr | None = None

    @field_validator("endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        for endpoint in value:
            parse_endpoint(endpoint)
        return value

    @field_validator("root")
    @classmethod
    def _check_root(cls, value: str) -> str:
        return validate_root(value)

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``[scheme://]host:port`` into ``(host, port)``.

    Raises:
        ValueError: the endpoint has no port, a non-numeric port or an
            unsupported scheme.
    """
    rest = endpoint.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"etcd endpoint {endpoint!r}: scheme must be http or https")
    rest = rest.rstrip("/")
    if rest.startswith("["):  # [::1]:2379
        host, _, port_text = rest[1:].partition("]:")
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise ValueError(f"etcd endpoint {endpoint!r} has no port (expected host:port)")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port with a port in 1-65535")
    return host, int(port_text)


__all__ = ["EtcdConfig", "parse_endpoint"]
