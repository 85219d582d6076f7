"""How jobs, events, errors and nodes read in the terminal (the text of ``tidal
status``, ``tidal nodes``, a followed job's events and what ``submit --no-wait``
says next). Pure functions of the API's models; widths come from
:mod:`service.cli.output`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from rendezvous.records import RUNNER_RANK
from service.api.models import JobEvent, JobView, NodeView
from service.cli.output import clock, labelled, table

TRACEBACK_LINES = 20


def bounds(view: JobView) -> str:
    """``MIN..MAX``: how many nodes the job may run on."""
    return f"{view.spec.min_nodes}..{view.spec.max_nodes}"


def event_line(event: JobEvent) -> str:
    """One event as a followed job prints it: time, phase, reason, message, world size."""
    extra = ""
    if event.world_size or event.nodes:
        extra = f" [world size {event.world_size}"
        extra += f": {', '.join(event.nodes)}]" if event.nodes else "]"
    return (f"{clock(event.time, with_date=False)}  {event.phase.value:<9}  "
            f"{event.reason.value:<15}  {event.message}{extra}")


def error_lines(view: JobView) -> list[str]:
    """Why a failed job failed: the failing rank (or runner) and the tail of its traceback."""
    err = view.error
    if err is None:
        return []
    how = f"signal {err.signal}" if err.signal else f"exit code {err.exit_code}"
    if err.rank == RUNNER_RANK:  # the node's runner: its message says it all
        lines = [err.message or f"the runner failed with {how}"]
    else:
        lines = [f"rank {err.rank} failed with {how}" + (f": {err.message}" if err.message else "")]
    if err.traceback:
        tail = err.traceback.rstrip().splitlines()[-TRACEBACK_LINES:]
        lines.append(f"last {len(tail)} line(s) of its traceback or stderr:")
        lines += [f"  {line}" for line in tail]
    return lines


def goodput_text(view: JobView) -> str | None:
    """``97.1% (lost 12.0 s: detection 1.0, restart 9.0, redone 2.0)``; None before any step."""
    if view.goodput is None:
        return None
    lost = {k: v for k, v in sorted(view.lost_seconds.items()) if v >= 0.05}
    if not lost:
        return f"{100 * view.goodput:.1f}%"
    causes = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in lost.items())
    return f"{100 * view.goodput:.1f}% (lost {sum(lost.values()):.1f} s: {causes})"


def status_text(view: JobView) -> str:
    """``tidal status``: the job's labelled values, its nodes' table and its error."""
    spec = view.spec
    restarts = str(view.restart_count)
    if view.restarts:
        restarts += " (" + ", ".join(f"{k}: {v}" for k, v in sorted(view.restarts.items())) + ")"
    step = "-" if view.last_step is None else str(view.last_step)
    if view.last_checkpoint_step is not None:
        step += f" (last checkpoint at step {view.last_checkpoint_step})"
    phase = view.phase.value + (" (cancel requested)" if view.cancel_requested
                                and not view.phase.is_terminal() else "")
    pairs: list[tuple[str, object]] = [
        ("job", view.job_id),
        ("phase", phase),
        ("command", shlex.join(spec.command)),
        ("nodes", f"{len(view.nodes)} of {bounds(view)}, {spec.nproc_per_node} worker(s) "
                  + (f"and {spec.gpus_per_node} GPU(s) " if spec.gpus_per_node else "")
                  + f"per node, world size {view.world_size}"),
        ("restarts", f"{restarts}, budget {spec.max_restarts}"),
        ("step", step),
        ("goodput", goodput_text(view)),
        ("priority", spec.priority),
        ("created", clock(view.created_at)),
        ("started", clock(view.started_at) if view.started_at else None),
        ("finished", clock(view.finished_at) if view.finished_at else None),
        ("exit reason", view.exit_reason.value if view.exit_reason else None),
    ]
    if spec.working_dir:
        pairs.append(("workdir", spec.working_dir))
    if spec.checkpoint_dir:
        pairs.append(("checkpoints", spec.checkpoint_dir))
    if spec.env_names:
        pairs.append(("env", ", ".join(spec.env_names)))
    if spec.node_selector:
        pairs.append(("labels", ", ".join(f"{k}={v}" for k, v in spec.node_selector.items())))
    pairs += [("condition", f"{cond.type}={cond.status} ({cond.reason}"
                            f"{': ' + cond.message if cond.message else ''})")
              for cond in view.conditions]
    lines = labelled(pairs)
    if view.nodes:
        gpus = any(n.devices for n in view.nodes)  # the GPUs column only for GPU jobs
        lines += ["", table(
            ["NODE", "STATE", "RANKS", *(["GPUS"] if gpus else []), "STEP", "RESTARTS"],
            [[n.node_id, n.state, ",".join(map(str, n.ranks)) or None,
              *([",".join(map(str, n.devices)) or None] if gpus else []), n.last_step,
              n.restart_count] for n in view.nodes],
            shrink=["RANKS"],
        )]
    errors = error_lines(view)
    if errors:
        lines += ["", "error: " + errors[0], *errors[1:]]
    return "\n".join(lines)


def nodes_table(nodes: Sequence[NodeView]) -> str:
    """``tidal nodes``: one row per node, then a line per GPU out of service."""
    text = table(
        ["NODE", "STATE", "SLOTS", "GPUS", "ADDRESS", "LABELS", "JOBS"],
        [[n.node_id, state_cell(n), f"{n.slots_used}/{n.slots}", gpus_cell(n), n.address,
          ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or None,
          ",".join(n.jobs) or None] for n in nodes],
        shrink=["JOBS", "LABELS", "ADDRESS"],
    )
    failed = [f"{n.node_id}: GPU {g.index}{' ' + g.uuid if g.uuid else ''} is out of service: "
              f"{g.fault or 'failed'}" for n in nodes for g in n.gpu_devices if not g.healthy]
    return "\n".join([text, *failed])


def state_cell(node: NodeView) -> str:
    """live or draining, and a straggler's condition: "live, slow 1.95x since 12:03:04Z"."""
    slow = node.slow
    if slow is None:
        return node.state
    return f"{node.state}, slow {slow.ratio:.2f}x since {slow.since:%H:%M:%S}Z"


def gpus_cell(node: NodeView) -> str | int:
    """GPUs asked for / healthy, and how many failed: "2/3 (1 failed)"."""
    if not node.gpu_devices:
        return node.gpus
    healthy = sum(1 for g in node.gpu_devices if g.healthy)
    failed = len(node.gpu_devices) - healthy
    return f"{node.gpus_used}/{healthy}" + (f" ({failed} failed)" if failed else "")


def next_steps(job_id: str) -> str:
    """What to type next about a job submitted without waiting."""
    return "\n".join([
        f"submitted job {job_id}; it runs without this command:",
        f"  follow it:      tidal status {job_id} --watch",
        f"  read its logs:  tidal logs {job_id} -f",
        f"  its history:    tidal events {job_id}",
        f"  stop it:        tidal cancel {job_id}",
    ])
