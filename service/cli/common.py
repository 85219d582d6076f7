"""What every ``tidal`` client command shares: the options that find the
coordinator, ``--json``, the client it connects with, and how a failure is
reported (``error: <message>`` and the exit code of its :mod:`service.client.errors` class).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

import click

from rendezvous.keys import InvalidIdentifierError, validate_id
from service.client import Client, TidalError, UnauthorizedError

F = TypeVar("F", bound=Callable[..., Any])


class CommandError(click.ClickException):
    """A failure shown as ``error: <message>`` on stderr, exiting with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def cli_error(exc: TidalError) -> CommandError:
    """A client error as the command line reports it: its message (with a hint
    for a wrong token) and its own exit code (service.client.errors)."""
    message = exc.message
    if isinstance(exc, UnauthorizedError):
        message += " (check --token, TIDAL_TOKEN or TIDAL_TOKEN_FILE)"
    return CommandError(message, exc.exit_code)


def reporting_errors(func: F) -> F:
    """Run a command's callback so that a :class:`TidalError` it raises becomes
    ``error: <message>`` and the error's exit code, not a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except TidalError as exc:
            raise cli_error(exc) from None

    return wrapper  # type: ignore[return-value]


# common options ------------------------------------------------------------------------


def target_options(func: F) -> F:
    options = [
        click.option("--url", metavar="URL", default=None,
                     help="Coordinator URL (default: $TIDAL_URL, else the cluster file)."),
        click.option("--token", metavar="TOKEN", default=None,
                     help="API token (default: $TIDAL_TOKEN, $TIDAL_TOKEN_FILE, else the "
                          "cluster file's; prefer those: flags show in `ps`)."),
        click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=None,
                     help="Where `tidal up` keeps cluster.json (default: $TIDAL_HOME, "
                          "else ~/.tidal)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print the API's JSON instead of a table.")(func)


def quiet_http_logs() -> None:
    # The `tidal` group logs at INFO; httpx would log every request there.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


@contextmanager
def connect(url: str | None, token: str | None, state_dir: Path | None) -> Iterator[Client]:
    """A client of the configured coordinator; its failures become
    :class:`CommandError` with their exit codes (4, 5 or 6)."""
    quiet_http_logs()
    try:
        with Client(url, token, state_dir=state_dir) as client:
            yield client
    except TidalError as exc:
        raise cli_error(exc) from None


def _check_id(value: str, *, what: str) -> str:
    try:
        return validate_id(value, what=what)
    except InvalidIdentifierError as exc:
        raise click.BadParameter(str(exc)) from None


def job_id_arg(_: click.Context, __: click.Parameter, value: str) -> str:
    """A click callback: ``value`` is a valid job id, else a usage error (exit 2)."""
    return _check_id(value, what="job id")


def node_id_arg(_: click.Context, __: click.Parameter, value: str) -> str:
    """A click callback: ``value`` is a valid node id, else a usage error (exit 2)."""
    return _check_id(value, what="node id")


def optional_node_id_arg(_: click.Context, __: click.Parameter, value: str | None) -> str | None:
    """As :func:`node_id_arg`, for an option that may be left out."""
    return None if value is None else _check_id(value, what="node id")
