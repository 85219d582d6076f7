"""The etcd part of every tidal process's settings (pydantic-settings, ``TIDAL_`` prefix).

The agent and the coordinator each have one settings class (flags >
``TIDAL_*`` environment > defaults); both reach etcd the same way, so the
fields that say how live here, once. So does :func:`settings_error_message`,
which turns a settings error into sentences that name each field and never
repeat a secret's value (pydantic's own text quotes the input, and a
model-level error quotes every field's).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode

from rendezvous.etcd import EtcdConfig
from rendezvous.keys import DEFAULT_ROOT

#: The etcd password of the agent's user; the runner takes it out of its
#: environment before starting any worker.
ETCD_PASSWORD = "TIDAL_ETCD_PASSWORD"  # noqa: S105 (a variable's name, not a secret)


class EtcdSettings(BaseSettings):
    """How a process reaches etcd: ``TIDAL_ETCD_ENDPOINTS`` (comma-separated or
    JSON), ``TIDAL_ETCD_ROOT``, ``TIDAL_ETCD_TIMEOUT_S``, TLS files, user, and
    password (``TIDAL_ETCD_PASSWORD``, or ``TIDAL_ETCD_PASSWORD_FILE``: a file
    holding it, so that it is in no process's environment)."""

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
    etcd_password_file: Path | None = None

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _split_endpoints(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _password_from_file(self) -> EtcdSettings:
        if self.etcd_password_file is None:
            return self
        if self.etcd_password is not None:
            raise ValueError(
                "etcd_password and etcd_password_file are both set: give one "
                "(TIDAL_ETCD_PASSWORD or --etcd-password-file)"
            )
        try:
            password = self.etcd_password_file.read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"etcd_password_file: cannot read {self.etcd_password_file}: {exc.strerror}"
            ) from None
        if not password:
            raise ValueError(f"etcd_password_file: {self.etcd_password_file} is empty")
        self.etcd_password = SecretStr(password)
        return self

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


def _secret_fields(model: type[BaseModel]) -> set[str]:
    """Names of ``model``'s fields whose type involves :class:`SecretStr`."""
    secret = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = typing.get_args(annotation)
        if annotation is SecretStr or SecretStr in args:
            secret.add(name)
    return secret


def settings_error_message(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line per error, naming the field and, unless it is a secret, the value.

    The value of a :class:`SecretStr` field is never printed, nor is the input
    of a model-level check (it holds every field, secrets included).

    Args:
        exc: what building ``model`` raised.
        model: the settings class (for which fields are secret).

    Returns:
        ``invalid settings:`` and one indented line per error.
    """
    secret = _secret_fields(model)
    lines = []
    for error in exc.errors(include_url=False, include_input=True):
        loc = ".".join(str(part) for part in error.get("loc", ()))
        message = str(error.get("msg", "invalid"))
        message = message.removeprefix("Value error, ")
        field = loc.split(".", 1)[0]
        value: Any = error.get("input")
        if loc and field not in secret and isinstance(value, (str, int, float, bool)):
            text = repr(value)
            shown = text if len(text) <= 80 else text[:77] + "..."
            lines.append(f"  {loc}: {message} (got {shown})")
        elif loc:
            lines.append(f"  {loc}: {message}")
        else:
            lines.append(f"  {message}")
    return "invalid settings:\n" + "\n".join(lines)
