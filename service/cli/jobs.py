"""The job commands of the `tidal` command line, as clients of the coordinator's API.

:func:`register` adds them to the ``tidal`` group::

    tidal submit [-f JOB.yaml] [--name N] [--min-nodes N] [--max-nodes M] [--nproc-per-node P]
                 [--workdir D] [--checkpoint-dir D] [--env K=V ...] [--label K=V ...]
                 [--max-restarts N] [--priority P] [--grace-period S]
                 [--global-batch-size B] [--lr-rule none|linear|sqrt]
                 [--zygote-preload MOD[,MOD...] ...]
                 [--no-wait | --timeout S] [--no-logs] [-- COMMAND [ARG ...]]
    tidal jobs    [--phase P] [--limit N | --all] [--json]
    tidal status  JOB [--watch [--timeout S]] [--json]
    tidal events  JOB [--json]
    tidal scale   JOB [--min N] [--max M] [--json]
    tidal cancel  JOB [--json]
    tidal logs    JOB [--node N] [--rank R] [--tail N] [-f] [--json]

and the node commands of :mod:`service.cli.nodes` (``nodes``, ``drain``, ``undrain``).
``submit`` and ``status --watch`` follow the job to its end with
:mod:`service.cli.follow`.

Every command takes ``--url``, ``--token`` and ``--state-dir``; the coordinator
is found by :func:`service.client.sync.resolve_target` (flags, then ``TIDAL_URL`` /
``TIDAL_TOKEN`` / ``TIDAL_TOKEN_FILE``, then the cluster file ``tidal up``
writes). Tables are for people and fit ``$COLUMNS`` or the terminal
(service.cli.output); every command takes ``--json`` and prints the API's own
JSON instead (JSON lines for ``logs``, ``status --watch`` and a followed
``submit``). ``submit --no-wait`` prints the job id alone on stdout and the
commands to follow, read and stop the job on stderr. Errors are one line,
``error: <message>``, on stderr.

Exit codes, which scripts can rely on; each failure is a class of
:mod:`service.client.errors` that carries its code, shared with the Python client:

* 0: done; for ``submit`` and ``status --watch``, the job SUCCEEDED;
* 1: the job FAILED (``submit``, ``status --watch``);
* 2: wrong usage: an unknown option, a missing argument, an invalid job spec
  (click's own code for usage errors);
* 3: the job was CANCELLED (``submit``, ``status --watch``);
* 4: the coordinator refused the request (401 wrong token, 404 unknown job or
  node, 409 not allowed in the job's phase, 413, 422 invalid values);
* 5: the coordinator could not be reached, did not answer in time, or failed
  (5xx, e.g. 503 when etcd is down);
* 6: no coordinator is configured (no ``--url``, ``TIDAL_URL`` or cluster
  file), or the token or cluster file cannot be read;
* 7: ``--timeout`` passed before the job ended (the job goes on);
* 130: interrupted with Ctrl-C while following (a submitted job goes on).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from service.api.models import JobPhase
from service.cli.common import (
    connect,
    job_id_arg,
    json_option,
    optional_node_id_arg,
    reporting_errors,
    target_options,
)
from service.cli.console import parse_log_line
from service.cli.follow import follow_human, follow_json
from service.cli.jobfile import JobFileError, job_fields
from service.cli.nodes import NODE_COMMANDS
from service.cli.output import age, dump_json, table
from service.cli.output import clock as _clock
from service.cli.views import bounds, next_steps, status_text
from service.client import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    InvalidSpecError,
    build_spec,
    default_name,
)

F = TypeVar("F", bound=Callable[..., Any])


# submit --------------------------------------------------------------------------------


def _pairs(values: Sequence[str], *, option: str, from_env: bool = False) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            if from_env and key in os.environ:
                value = os.environ[key]
            elif from_env:
                raise click.BadParameter(
                    f"{key!r} is not KEY=VALUE and not set in this environment",
                    param_hint=option)
            else:
                raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=option)
        out[key] = value
    return out


def _modules(values: Sequence[str]) -> list[str]:
    """``--zygote-preload`` values, each one module or a comma list, in order (blanks dropped).

    The names are validated with the job spec, by the same rule as the coordinator's.
    """
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


MAX_JOB_FILE_BYTES = 1 << 20


def _job_file_fields(path: str, flags: dict[str, Any]) -> dict[str, Any]:
    """The job file's fields with ``flags`` over them; a bad file is a usage error (exit 2)."""
    source = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_JOB_FILE_BYTES + 1)
        else:
            with open(path, "rb") as handle:
                data = handle.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as exc:
        raise InvalidSpecError(f"cannot read the job file {source}: {exc.strerror}") from None
    if len(data) > MAX_JOB_FILE_BYTES:
        raise InvalidSpecError(f"{source}: larger than {MAX_JOB_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidSpecError(f"{source}: not UTF-8 text") from None
    try:
        fields = job_fields(text, flags, source=source)
    except JobFileError as exc:
        raise InvalidSpecError(str(exc)) from None
    return fields


# Options end where COMMAND starts, so its own options (`--lr 0.1`) stay its own.
@click.command("submit", context_settings={"allow_interspersed_args": False})
@click.option("-f", "--file", "job_file", metavar="FILE",
              type=click.Path(dir_okay=False, allow_dash=True),
              help="A YAML job file with the job spec's fields (`-` reads stdin); "
                   "flags override it, a COMMAND after `--` replaces its command.")
@click.option("--name", help="Readable name; the job id is NAME-<suffix> "
              "(default: from the command, e.g. `train` for `python train.py`).")
@click.option("--min-nodes", type=click.IntRange(1), default=None,
              help="Fewest nodes the job runs on (default 1).")
@click.option("--max-nodes", type=click.IntRange(1), default=None,
              help="Most nodes the job grows to (default: --min-nodes).")
@click.option("--nproc-per-node", type=click.IntRange(1), default=None,
              help="Worker processes per node (default: --gpus-per-node, else 1).")
@click.option("--gpus-per-node", type=click.IntRange(0), default=None,
              help="GPUs each node gives the job; its workers see only those (default 0).")
@click.option("--workdir", help="Working directory, relative to the coordinator's "
              "--workdir-root.")
@click.option("--checkpoint-dir", help="Checkpoint directory, relative to the "
              "coordinator's --checkpoint-root.")
@click.option("--env", "env", multiple=True, metavar="KEY[=VALUE]",
              help="Environment variable for the workers; KEY alone copies it from here. "
                   "Repeatable. Values are never shown back.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Run only on nodes carrying this label. Repeatable.")
@click.option("--max-restarts", type=click.IntRange(0), default=None,
              help="Worker failures the job survives (default 3).")
@click.option("--priority", type=int, default=None, help="Higher is scheduled first (default 0).")
@click.option("--queue", default=None, help="The queue the job runs in (default: default).")
@click.option("--grace-period", "grace_period_s", type=click.FloatRange(min=0, min_open=True),
              default=None, help="Seconds between SIGTERM and SIGKILL when workers stop "
              "(default 30).")
@click.option("--global-batch-size", type=click.IntRange(1), default=None,
              help="Keep this many samples per step whatever the world size.")
@click.option("--lr-rule", type=click.Choice(["none", "linear", "sqrt"]), default=None,
              help="Scale the learning rate with the world size by this rule.")
@click.option("--zygote-preload", "zygote_preload", multiple=True, metavar="MOD[,MOD...]",
              help="Modules the job's zygote imports after torch (e.g. transformers,lightning), "
                   "so restarted and joining workers do not pay their import. Repeatable.")
@click.option("--no-wait", is_flag=True,
              help="Print the job id (and on stderr how to follow, read and stop it) and "
                   "return at once instead of following the job.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=None, help="Stop following after this many seconds (exit 7).")
@click.option("--no-logs", is_flag=True,
              help="While following, do not print the workers' output (by default it is "
                   "streamed from the coordinator, each line prefixed [NODE rRANK]).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--json", "as_json", is_flag=True,
              help="Print the new job's JSON (JobView); while following, one JSON line "
                   "per change, as `status --watch --json`.")
@target_options
def submit_command(
    job_file: str | None, name: str | None, min_nodes: int | None, max_nodes: int | None,
    nproc_per_node: int | None, gpus_per_node: int | None,
    workdir: str | None, checkpoint_dir: str | None, env: tuple[str, ...],
    labels: tuple[str, ...], max_restarts: int | None, priority: int | None, queue: str | None,
    grace_period_s: float | None, global_batch_size: int | None, lr_rule: str | None,
    zygote_preload: tuple[str, ...], no_wait: bool, timeout_s: float | None, no_logs: bool,
    command: tuple[str, ...], as_json: bool,
    url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Submit a job running COMMAND on every worker, then follow it to its end.

    Like torchrun, but elastic: the job starts once MIN nodes are free and
    grows to MAX. Put COMMAND after `--`, e.g.

        tidal submit --min-nodes 1 --max-nodes 3 -- python train.py --lr 0.1

    or keep the job in a YAML file (keys as in the API's job spec) and
    override what you like:

        tidal submit -f job.yaml --max-nodes 4 [-- python train.py --lr 0.2]

    Prints the job's events as they happen and exits with its outcome: 0
    succeeded, 1 failed, 3 cancelled (2 is a usage error, 4/5/6 an API,
    connection or configuration error, 7 --timeout, 130 Ctrl-C; the job goes
    on after Ctrl-C). With --no-wait, prints the job id on stdout and the
    commands to follow, read and stop it on stderr.
    """
    flags: dict[str, Any] = {
        "name": name, "command": list(command) or None, "min_nodes": min_nodes,
        "max_nodes": max_nodes, "nproc_per_node": nproc_per_node,
        "gpus_per_node": gpus_per_node, "working_dir": workdir,
        "checkpoint_dir": checkpoint_dir, "max_restarts": max_restarts, "priority": priority,
        "queue": queue,
        "grace_period_s": grace_period_s,
        "env": _pairs(env, option="--env", from_env=True) if env else None,
        "node_selector": _pairs(labels, option="--label") if labels else None,
        "zygote_preload": _modules(zygote_preload) if zygote_preload else None,
    }
    policy = {"global_batch_size": global_batch_size, "lr_rule": lr_rule}
    if job_file is not None:
        flags["resize_policy"] = {k: v for k, v in policy.items() if v is not None} or None
        fields = _job_file_fields(job_file, flags)
    else:
        if not command:
            raise click.UsageError("give the COMMAND after `--`, or a job file with -f")
        fields = {k: v for k, v in flags.items() if v is not None}
        fields.setdefault("min_nodes", 1)
        fields.setdefault("max_nodes", fields["min_nodes"])
        if global_batch_size is not None or lr_rule is not None:
            fields["resize_policy"] = {"global_batch_size": global_batch_size,
                                       "lr_rule": lr_rule or "none"}
    fields.setdefault("name", default_name(fields["command"]))
    spec = build_spec(fields)
    with connect(url, token, state_dir) as client:
        view = client.submit(spec)
        if as_json and no_wait:
            click.echo(dump_json(view))
            return
        if as_json:  # its first line is the new job's view
            raise click.exceptions.Exit(follow_json(client, view.job_id, timeout_s=timeout_s))
        if no_wait:
            click.echo(view.job_id)
            click.echo(next_steps(view.job_id), err=True)
            return
        click.echo(f"submitted job {view.job_id} ({bounds(view)} node(s) x "
                   f"{spec.nproc_per_node} worker(s)); following it, Ctrl-C to stop")
        code = follow_human(client, view.job_id, timeout_s=timeout_s, logs=not no_logs)
    if code != EXIT_OK:
        raise click.exceptions.Exit(code)


# reading jobs ----------------------------------------------------------------


@click.command("jobs")
@click.option("--phase", type=click.Choice([p.value for p in JobPhase], case_sensitive=False),
              default=None, help="Only jobs in this phase.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              help="Jobs per page.")
@click.option("--all", "all_pages", is_flag=True, help="Every page, not just the first.")
@json_option
@target_options
def jobs_command(
    phase: str | None, limit: int, all_pages: bool, as_json: bool,
    url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """List jobs, oldest first."""
    wanted = JobPhase(phase.upper()) if phase else None
    with connect(url, token, state_dir) as client:
        if all_pages:
            views, more = list(client.iter_jobs(phase=wanted)), None
        else:
            page = client.list_page(phase=wanted, limit=limit)
            views, more = page.jobs, page.next_cursor
    if as_json:
        click.echo(dump_json({"jobs": [v.model_dump(mode="json") for v in views],
                              "next_cursor": more}))
        return
    if not views:
        click.echo("no jobs" + (f" in phase {wanted.value}" if wanted else ""), err=True)
        return
    click.echo(table(
        ["JOB", "PHASE", "NODES", "WORLD", "RESTARTS", "STEP", "AGE", "COMMAND"],
        [[v.job_id, v.phase.value, f"{len(v.nodes)} ({bounds(v)})", v.world_size,
          v.restart_count, v.last_step, age(v.created_at), shlex.join(v.spec.command)]
         for v in views],
        shrink=["COMMAND"],
    ))
    if more:
        click.echo(f"more jobs than --limit {limit}: use --all", err=True)


@click.command("status")
@click.argument("job", callback=job_id_arg)
@click.option("--watch", is_flag=True,
              help="Follow the job until it ends; exit 0 succeeded, 1 failed, 3 cancelled.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=None, help="With --watch: stop after this many seconds (exit 7).")
@json_option
@target_options
def status_command(
    job: str, watch: bool, timeout_s: float | None, as_json: bool,
    url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Show one job: phase, nodes, restarts, progress and the error of a failed job.

    With --json, the API's JobView; with --watch --json, one JSON line per change.
    """
    with connect(url, token, state_dir) as client:
        if watch and as_json:
            code = follow_json(client, job, timeout_s=timeout_s)
        else:
            view = client.get_job(job)
            if as_json:
                click.echo(dump_json(view))
                return
            click.echo(status_text(view))
            if not watch:
                return
            click.echo("")
            code = follow_human(client, job, timeout_s=timeout_s)
    if code != EXIT_OK:
        raise click.exceptions.Exit(code)


@click.command("events")
@click.argument("job", callback=job_id_arg)
@json_option
@target_options
def events_command(
    job: str, as_json: bool, url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Show a job's history: every phase change and resize, with its reason."""
    with connect(url, token, state_dir) as client:
        events = client.events(job)
    if as_json:
        click.echo(dump_json(events))
        return
    click.echo(table(
        ["SEQ", "TIME", "PHASE", "REASON", "WORLD", "NODES", "MESSAGE"],
        [[e.seq, _clock(e.time), e.phase.value, e.reason.value, e.world_size,
          ",".join(e.nodes) or None, e.message] for e in events.events],
        shrink=["MESSAGE", "NODES"],
    ))


# changing jobs ---------------------------------------------------------------


@click.command("scale")
@click.argument("job", callback=job_id_arg)
@click.option("--min", "min_nodes", type=click.IntRange(1), default=None,
              help="New minimum number of nodes.")
@click.option("--max", "max_nodes", type=click.IntRange(1), default=None,
              help="New maximum number of nodes.")
@json_option
@target_options
def scale_command(
    job: str, min_nodes: int | None, max_nodes: int | None, as_json: bool,
    url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Change how many nodes JOB may run on.

    New bounds alone restart nothing; nodes released by a lower maximum leave as
    drained ones do, and a higher maximum lets idle nodes join (live when the
    job's script supports it, else from the newest checkpoint)."""
    if min_nodes is None and max_nodes is None:
        raise click.UsageError("give --min, --max or both")
    with connect(url, token, state_dir) as client:
        view = client.scale(job, min_nodes=min_nodes, max_nodes=max_nodes)
    if as_json:
        click.echo(dump_json(view))
        return
    click.echo(f"job {view.job_id}: {bounds(view)} node(s), now {view.phase.value} "
               f"on {len(view.nodes)}")


@click.command("cancel")
@click.argument("job", callback=job_id_arg)
@json_option
@target_options
def cancel_command(
    job: str, as_json: bool, url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Cancel JOB: its workers get SIGTERM (time to checkpoint), then SIGKILL.

    Returns once the cancel is recorded; `tidal status JOB --watch` waits for
    the end (exit 3). Cancelling a job that already ended is refused (exit 4).
    """
    with connect(url, token, state_dir) as client:
        view = client.cancel(job)
    if as_json:
        click.echo(dump_json(view))
        return
    click.echo(f"cancelling job {view.job_id} (was {view.phase.value})")


# logs ----------------------------------------------------------------------------------


@click.command("logs")
@click.argument("job", callback=job_id_arg)
@click.option("--node", default=None, callback=optional_node_id_arg,
              help="Only this node's workers.")
@click.option("--rank", type=click.IntRange(0), default=None,
              help="Only this local rank (the worker's index on its node).")
@click.option("--tail", type=click.IntRange(0), default=None,
              help="Only the last N lines of each worker's newest attempt.")
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing new lines until the job ends (or Ctrl-C).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line: node, rank and line (or tidal: a message "
                   "of the coordinator's).")
@target_options
def logs_command(
    job: str, node: str | None, rank: int | None, tail: int | None, follow: bool,
    as_json: bool, url: str | None, token: str | None, state_dir: Path | None,
) -> None:
    """Print the workers' output of JOB, each line prefixed [NODE rRANK].

    Works from any machine that reaches the coordinator: it reads the logs
    from the nodes' agents. RANK is the local rank (a worker's index on its
    node); every attempt is shown, oldest first, one node after the other
    (with -f, interleaved as they come). Lines starting [tidal] are the
    coordinator's: a node that is gone, a node starting a new attempt.
    """
    with connect(url, token, state_dir) as client:
        try:
            for line in client.logs(job, node=node, rank=rank, tail=tail, follow=follow):
                click.echo(json.dumps(parse_log_line(line)) if as_json else line)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


COMMANDS: tuple[click.Command, ...] = (
    submit_command, jobs_command, status_command, events_command, scale_command,
    cancel_command, logs_command, *NODE_COMMANDS,
)


def register(group: click.Group) -> None:
    """Add the job and node commands to ``group`` (the ``tidal`` command line);
    a :class:`TidalError` any of them raises is reported, with its exit code."""
    for command in COMMANDS:
        if command.callback is not None:
            command.callback = reporting_errors(command.callback)
        group.add_command(command)
