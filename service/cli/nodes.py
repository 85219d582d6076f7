"""The node commands of the `tidal` command line::

    tidal nodes   [--json]
    tidal drain   NODE [--json]
    tidal undrain NODE [--json]

Registered with the job commands by :func:`service.cli.jobs.register`.
"""

from __future__ import annotations

from pathlib import Path

import click

from service.cli.common import connect, json_option, node_id_arg, target_options
from service.cli.output import dump_json
from service.cli.views import nodes_table


@click.command("nodes")
@json_option
@target_options
def nodes_command(
    as_json: bool, url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """List the live nodes: state (and slow, for a straggler cooling down), slots in use,
    labels and their jobs."""
    with connect(url, token, state_dir) as client:
        nodes = client.nodes()
    if as_json:
        click.echo(dump_json(list(nodes)))
        return
    if not nodes:
        click.echo("no nodes are registered", err=True)
        return
    click.echo(nodes_table(nodes))


@click.command("drain")
@click.argument("node", callback=node_id_arg)
@json_option
@target_options
def drain_command(
    node: str, as_json: bool, url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Take NODE out of service: its jobs checkpoint and go on without it."""
    with connect(url, token, state_dir) as client:
        view = client.drain(node)
    if as_json:
        click.echo(dump_json(view))
        return
    jobs = f"; its jobs move off it: {', '.join(view.jobs)}" if view.jobs else ""
    click.echo(f"node {view.node_id} is {view.state}{jobs}")


@click.command("undrain")
@click.argument("node", callback=node_id_arg)
@json_option
@target_options
def undrain_command(
    node: str, as_json: bool, url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Put a drained NODE back in service (and clear its slow condition, if any)."""
    with connect(url, token, state_dir) as client:
        view = client.undrain(node)
    if as_json:
        click.echo(dump_json(view))
        return
    click.echo(f"node {view.node_id} is {view.state}")


NODE_COMMANDS: tuple[click.Command, ...] = (nodes_command, drain_command, undrain_command)
