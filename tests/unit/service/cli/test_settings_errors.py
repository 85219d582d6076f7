"""Invalid settings: exit status 2, a line naming each field, never a secret's value.

pydantic's own message quotes each bad input, and a model-level check quotes
the whole input, every field's secret included (``TIDAL_TOKEN``,
``TIDAL_ETCD_PASSWORD``). The commands are run in process with click's runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from pydantic import ValidationError

from rendezvous.etcd.settings import settings_error_message
from service.cli.main import cli
from service.coordinator.settings import CoordinatorSettings

TOKEN = "tok-SECRET-0123456789abcdef"
PASSWORD = "pw-SECRET-0123456789abcdef"
SECRET_PARTS = ("SECRET", TOKEN[:6], PASSWORD[:6])


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TIDAL_"):
            monkeypatch.delenv(name)


def _run(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Result:
    _clean_env(monkeypatch)
    return CliRunner().invoke(cli, args, env=env, catch_exceptions=False)


def _assert_no_secret(text: str) -> None:
    for part in SECRET_PARTS:
        assert part not in text, f"{part!r} was printed:\n{text}"


def test_model_level_error_names_the_problem_without_the_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _run(
        ["coordinator", "--host", "0.0.0.0", "--insecure-no-auth"],
        {"TIDAL_TOKEN": TOKEN, "TIDAL_ETCD_PASSWORD": PASSWORD, "TIDAL_ETCD_USER": "u"},
        monkeypatch,
    )
    assert result.exit_code == 2, result.output
    assert "--insecure-no-auth serves on loopback only" in result.output
    _assert_no_secret(result.output)


def test_field_error_names_the_field_and_its_value_when_not_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _run(["coordinator"], {"TIDAL_TOKEN": TOKEN, "TIDAL_ELECTION_TTL_S": "1",
                                    "TIDAL_ETCD_PASSWORD": PASSWORD}, monkeypatch)
    assert result.exit_code == 2, result.output
    assert "election_ttl_s" in result.output and "(got '1')" in result.output
    _assert_no_secret(result.output)


def test_agent_settings_error_exits_2_without_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _run(["agent", "--slots", "0"],
                  {"TIDAL_ETCD_PASSWORD": PASSWORD, "TIDAL_NODE_ID": "a/b"}, monkeypatch)
    assert result.exit_code == 2, result.output
    assert "slots" in result.output and "node_id" in result.output
    _assert_no_secret(result.output)


def test_password_and_password_file_together_are_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text(PASSWORD + "\n")
    result = _run(["agent", "--etcd-user", "tidal-agent", "--etcd-password-file",
                   str(password_file)], {"TIDAL_ETCD_PASSWORD": PASSWORD}, monkeypatch)
    assert result.exit_code == 2, result.output
    assert "etcd_password and etcd_password_file are both set" in result.output
    _assert_no_secret(result.output)


def test_unreadable_password_file_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    missing = tmp_path / "nope"
    result = _run(["coordinator", "--etcd-user", "u", "--etcd-password-file", str(missing)],
                  {"TIDAL_TOKEN": TOKEN}, monkeypatch)
    assert result.exit_code == 2, result.output
    assert f"etcd_password_file: cannot read {missing}" in result.output
    _assert_no_secret(result.output)


def test_password_file_sets_the_password(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    _clean_env(monkeypatch)
    password_file = tmp_path / "pw"
    password_file.write_text(PASSWORD + "\n")
    settings = CoordinatorSettings(token=TOKEN, etcd_user="u",  # type: ignore[arg-type]
                                   etcd_password_file=password_file)
    password = settings.etcd_config().password
    assert password is not None and password.get_secret_value() == PASSWORD


def test_message_never_holds_a_secret_field_s_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even an error on the secret field itself names it without its value."""
    _clean_env(monkeypatch)
    with pytest.raises(ValidationError) as caught:
        CoordinatorSettings(token=12345678901234567890)  # type: ignore[arg-type]
    message = settings_error_message(caught.value, CoordinatorSettings)
    assert message.startswith("invalid settings:\n  token: ")
    assert "12345678901234567890" not in message
