"""`tidal up`, the command: a :class:`service.up.cluster.LocalCluster` run until interrupted.

It prints where everything is, optionally runs a local Prometheus scraping the
cluster, and waits for Ctrl-C or SIGTERM; the cluster's supervisor restarts a
coordinator or agent that dies, and only etcd's exit stops everything early.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from service.client.target import default_state_dir
from service.coordinator.settings import SettingsError
from service.up.cluster import (
    DEATH_SIGNAL,
    DEFAULT_AGENTS,
    ChildExit,
    ClusterError,
    LocalCluster,
    StartCancelledError,
)
from service.up.prometheus import LocalPrometheus, PrometheusError, target_of


def _example_submit(cluster: LocalCluster) -> str:
    body = json.dumps({"name": "hello", "command": ["echo", "hello from tidal"]})
    return (
        f'curl -sS -H "Authorization: Bearer $(cat {shlex.quote(str(cluster.token_file))})" '
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)} {cluster.url}/v1/jobs"
    )


def _announce(cluster: LocalCluster, prometheus: LocalPrometheus | None = None) -> None:
    nodes = ", ".join(cluster.node_ids) or "none"
    click.echo(f"tidal is up: coordinator at {cluster.url}, node(s) {nodes}")
    click.echo(f"  API token:  {cluster.token_file}")
    click.echo(f"  etcd:       {cluster.etcd_endpoint} (etcd {cluster.etcd_version})")
    click.echo(f"  logs:       {cluster.logs_dir}/ (etcd, coordinator, node-<i>); "
               f"workers' logs under {cluster.run_root}/<node>/jobs/")
    click.echo(f"  state:      {cluster.cluster_file}")
    if prometheus is not None:
        click.echo(f"  prometheus: {prometheus.url} (scrapes the coordinator and every agent; "
                   f"log {prometheus.log_path})")
    click.echo("Submit a job:")
    click.echo(f"  {_example_submit(cluster)}")
    click.echo("Ctrl-C stops everything.")


@click.command("up")
@click.option("--agents", "agent_count", type=click.IntRange(0, 256), default=DEFAULT_AGENTS,
              show_default=True, help="Node agents to start (node-1 .. node-N).")
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), envvar="TIDAL_HOME",
              default=None, help="Token, logs, run dirs, etcd data, cluster.json "
              "(default: $TIDAL_HOME, else ~/.tidal).")
@click.option("--workdir-root", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None, help="Jobs' working directories lie under this (default: the "
              "current directory).")
@click.option("--checkpoint-root", type=click.Path(path_type=Path, file_okay=False),
              default=None, help="Jobs' checkpoint directories lie under this "
              "(default: STATE/checkpoints).")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=1), default=60.0,
              show_default=True, help="Seconds to wait for the cluster to be ready.")
@click.option("--prometheus", "with_prometheus", is_flag=True, default=False,
              help="Also run a local Prometheus (the `prometheus` binary on PATH) scraping the "
              "coordinator and every agent, with tidal's alerting rules; prints its URL.")
@click.option("--gpus-per-agent", type=click.IntRange(0, 64), default=None,
              help="Give each agent this many GPU indices (node-1: 0..N-1, node-2: N..2N-1), "
              "NVML or not: GPU placement on a machine without GPUs (default: each agent "
              "finds its GPUs).")
def up_command(
    agent_count: int,
    gpus_per_agent: int | None,
    state_dir: Path | None,
    workdir_root: Path | None,
    checkpoint_root: Path | None,
    ready_timeout_s: float,
    with_prometheus: bool,
) -> None:
    """Run etcd, a coordinator and node agents on this machine until interrupted.

    The API token is $TIDAL_TOKEN if set, else a random one; either way it is
    written to STATE/token. etcd runs with authentication on (its passwords in
    STATE/etcd-auth/). A coordinator or agent that dies is started again; only
    etcd's exit stops everything. What runs is described in STATE/cluster.json.
    """
    try:
        cluster = LocalCluster(
            state_dir=state_dir or default_state_dir(),
            agents=agent_count,
            gpus_per_agent=gpus_per_agent,
            workdir_root=workdir_root,
            checkpoint_root=checkpoint_root,
            token=os.environ.get("TIDAL_TOKEN") or None,
            ready_timeout_s=ready_timeout_s,
        )
        prometheus = LocalPrometheus(
            directory=cluster.state_dir / "prometheus",
            log_path=cluster.logs_dir / "prometheus.log",
            ready_timeout_s=ready_timeout_s,
            parent_death_signal=DEATH_SIGNAL,  # dies with `tidal up`, as the cluster does
        ) if with_prometheus else None
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    except PrometheusError as exc:
        raise click.ClickException(str(exc)) from exc
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    failure: str | None = None
    try:
        cluster.start(cancel=stop)
        if prometheus is not None:
            agents = [f"127.0.0.1:{a.metrics_port}" for a in cluster.describe().agents]
            prometheus.start(coordinator=target_of(cluster.url), agents=agents)
        _announce(cluster, prometheus)
        while failure is None and not stop.wait(0.5):
            failure = _report_exits(cluster.check())
    except StartCancelledError:
        pass  # stopped by a signal while starting: not an error
    except (ClusterError, PrometheusError) as exc:
        failure = str(exc)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the stop below is bounded; let it finish
        if received:
            click.echo(f"{received[0]}: stopping everything", err=True)
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()
    if failure is not None:
        raise click.ClickException(failure)
    click.echo("stopped", err=True)


def _report_exits(exits: list[ChildExit]) -> str | None:
    """Say which children died; return an error message if the cluster cannot go on.

    A coordinator or agent that died is started again by the cluster's
    supervisor, which logs it; only etcd's death ends ``tidal up``.
    """
    for ex in exits:
        if ex.essential:
            return (f"the {ex.name} (pid {ex.pid}) exited with code {ex.returncode}; "
                    f"stopping everything\n{ex.log_tail}")
    return None


