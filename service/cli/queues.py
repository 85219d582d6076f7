"""``tidal queue``: create, list, change and delete queues (service.coordinator.routes.queues).

``tidal queue create NAME --guaranteed N [--limit M] [--weight W]``,
``tidal queue list``, ``tidal queue set NAME ...``, ``tidal queue delete NAME``.
Creating and changing need the admin token; a warning from the coordinator (the
guarantees add up to more than the cluster holds) is printed on stderr.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from service.api.queues import QUEUE_PATTERN, QueueChanged
from service.cli.common import connect
from service.cli.common import json_option as _json_option
from service.cli.common import target_options as _target_options
from service.cli.output import dump_json, table


def _check_name(_: click.Context, __: click.Parameter, value: str) -> str:
    if not re.fullmatch(QUEUE_PATTERN, value):
        raise click.BadParameter(f"queue name {value!r} is not valid: use 1-63 characters "
                                 "from [A-Za-z0-9._-], starting with a letter or digit")
    return value


def _show_changed(changed: QueueChanged, verb: str, as_json: bool) -> None:
    if as_json:
        click.echo(dump_json(changed.model_dump(mode="json")))
    else:
        q = changed.queue
        limit = q.limit if q.limit is not None else "none"
        click.echo(f"{verb} queue {q.name}: guaranteed {q.guaranteed}, limit {limit}, "
                   f"weight {q.weight:g}")
    if changed.warning:
        click.echo(f"warning: {changed.warning}", err=True)


@click.group("queue")
def queue_group() -> None:
    """Queues: guaranteed slots, limits and weights for sharing idle slots."""


@queue_group.command("create")
@click.argument("name", callback=_check_name)
@click.option("--guaranteed", type=click.IntRange(0), default=0, show_default=True,
              help="Slots the queue gets whenever its jobs want them.")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="Most slots its jobs hold at once (default: no limit).")
@click.option("--weight", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Share of the idle slots beyond the guarantees.")
@_json_option
@_target_options
def create_command(name: str, guaranteed: int, limit: int | None, weight: float, as_json: bool,
                   url: str | None, token: str | None, state_dir: Path | None) -> None:
    """Create queue NAME (admin token)."""
    with connect(url, token, state_dir) as client:
        changed = client.create_queue(name, guaranteed=guaranteed, limit=limit, weight=weight)
    _show_changed(changed, "created", as_json)


@queue_group.command("set")
@click.argument("name", callback=_check_name)
@click.option("--guaranteed", type=click.IntRange(0), default=None)
@click.option("--limit", type=click.IntRange(1), default=None)
@click.option("--no-limit", is_flag=True, help="Remove the limit.")
@click.option("--weight", type=click.FloatRange(min=0, min_open=True), default=None)
@_json_option
@_target_options
def set_command(name: str, guaranteed: int | None, limit: int | None, no_limit: bool,
                weight: float | None, as_json: bool,
                url: str | None, token: str | None, state_dir: Path | None) -> None:
    """Change queue NAME's guarantee, limit or weight (admin token)."""
    body: dict[str, Any] = {k: v for k, v in (("guaranteed", guaranteed), ("limit", limit),
                                                ("weight", weight)) if v is not None}
    if no_limit:
        body["limit"] = None
    if not body:
        raise click.UsageError("give --guaranteed, --limit, --no-limit or --weight")
    with connect(url, token, state_dir) as client:
        changed = client.update_queue(name, **body)
    _show_changed(changed, "changed", as_json)


@queue_group.command("list")
@_json_option
@_target_options
def list_command(as_json: bool, url: str | None, token: str | None,
                 state_dir: Path | None) -> None:
    """Queues and their slots: guaranteed, in use, borrowed beyond the guarantee,
    waiting (what waiting jobs need to start)."""
    with connect(url, token, state_dir) as client:
        listed = client.queues()
    if as_json:
        click.echo(dump_json(listed.model_dump(mode="json")))
    else:
        click.echo(table(
            ["QUEUE", "GUARANTEED", "LIMIT", "WEIGHT", "IN USE", "BORROWED", "WAITING", "JOBS"],
            [[q.name, q.guaranteed, q.limit, f"{q.weight:g}", q.in_use, q.borrowed, q.waiting,
              f"{q.jobs_running} running, {q.jobs_waiting} waiting"] for q in listed.queues],
            shrink=["QUEUE"],
        ))
        click.echo(f"capacity {listed.capacity} slot(s), {listed.guaranteed_total} guaranteed")
    if listed.warning:
        click.echo(f"warning: {listed.warning}", err=True)


@queue_group.command("delete")
@click.argument("name", callback=_check_name)
@_target_options
def delete_command(name: str, url: str | None, token: str | None,
                   state_dir: Path | None) -> None:
    """Delete queue NAME; refused while unfinished jobs use it (admin token)."""
    with connect(url, token, state_dir) as client:
        client.delete_queue(name)
    click.echo(f"deleted queue {name}")


def register(group: click.Group) -> None:
    """Add ``tidal queue`` to the command line."""
    group.add_command(queue_group)
