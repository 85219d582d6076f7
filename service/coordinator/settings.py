"""Configuration of one coordinator process: flags > TIDAL_* environment > defaults.

Also the one way the CLI turns invalid settings into an error
(:func:`build_settings`, :class:`SettingsError`): exit status 2, a line per
field, never a secret's value.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import TypeVar

import click
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from rendezvous.etcd.settings import EtcdSettings, settings_error_message

S = TypeVar("S", bound=BaseModel)


class SettingsError(click.ClickException):
    """Invalid settings: exit status 2, as for a usage error."""

    exit_code = 2


def build_settings(model: type[S], given: dict[str, object]) -> S:
    """``model(**given)`` (flags over ``TIDAL_*`` over defaults).

    Raises:
        SettingsError: a message naming each bad field, without any secret's value.
    """
    try:
        return model(**given)
    except ValidationError as exc:
        raise SettingsError(settings_error_message(exc, model)) from None


def _replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CoordinatorSettings(EtcdSettings):
    """Everything `tidal coordinator` can be told (``TIDAL_HOST``, ``TIDAL_PORT``,
    ``TIDAL_TOKEN``, ``TIDAL_TOKEN_FILE``, ``TIDAL_WORKDIR_ROOT``, ...)."""

    model_config = SettingsConfigDict(env_prefix="TIDAL_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=0, le=65535)
    token: SecretStr | None = None
    token_file: Path | None = None
    # Tokens scoped to queues, one `QUEUE[,QUEUE...] TOKEN` a line
    # (service.coordinator.routes.access).
    queue_tokens_file: Path | None = None
    insecure_no_auth: bool = False
    workdir_root: Path = Field(default_factory=Path.cwd)
    checkpoint_root: Path = Field(default_factory=lambda: Path.cwd() / ".tidal" / "checkpoints")
    election_ttl_s: int = Field(default=5, ge=2, le=300)
    reconcile_interval_s: float = Field(default=2.0, gt=0, le=300)
    # How long a node evicted from a job as a straggler takes no new placements
    # (its `slow` condition; `tidal undrain` clears it).
    straggler_cooldown_s: float = Field(default=600.0, ge=0, le=7 * 24 * 3600)
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    replica_id: str = Field(default_factory=_replica_id, max_length=256)
    # The web page links each job to tidal's dashboard on this Grafana.
    grafana_url: str | None = Field(default=None, max_length=2048,
                                    pattern=r"^https?://[^\s\"'<>\\]+$")

    @model_validator(mode="after")
    def _auth(self) -> CoordinatorSettings:
        if self.insecure_no_auth:
            if not is_loopback(self.host):
                raise ValueError(
                    f"--insecure-no-auth serves on loopback only, not on host {self.host!r}"
                )
        elif self.token is None and self.token_file is None:
            raise ValueError(
                "no API token: set --token, TIDAL_TOKEN or --token-file "
                "(or --insecure-no-auth to serve without one, on loopback only)"
            )
        return self

    def resolve_token(self) -> str | None:
        """The bearer token every /v1 call must carry; None when auth is off.

        Raises:
            ValueError: the token file is unreadable or empty, or the token is too short.
        """
        if self.insecure_no_auth:
            return None
        if self.token is not None:
            token = self.token.get_secret_value().strip()
        else:
            assert self.token_file is not None
            try:
                token = self.token_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read the token file {self.token_file}: {exc}") from exc
        if len(token) < 16:
            raise ValueError("the API token must be at least 16 characters")
        return token
