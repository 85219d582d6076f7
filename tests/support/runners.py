"""Where a job's runners are stuck: every thread's stack, from their own logs.

A runner (``python -m agent.runner``) writes every thread's stack into its
``runner.log`` on SIGUSR1 (faulthandler, in agent.runner's main). A test that
times out waiting for a job asks every runner of the job for its stacks and
shows the logs' tails, so that a hang that happens once in many runs can be
read from the failure itself.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.processes import dump_stacks

RUNNER_PID = re.compile(r"warm runner (\d+) takes job")


def runner_pid(log_path: Path) -> int | None:
    """The pid of the runner that writes ``log_path``, if it is still a runner."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    found = RUNNER_PID.search(text)
    if found is None:
        return None
    pid = int(found.group(1))
    try:  # only a runner of ours: the pid its log names, still running agent.runner
        if b"agent.runner" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
    except OSError:
        return None
    return pid


def runner_stacks(run_root: Path, job_id: str, *, lines: int = 60) -> str:
    """SIGUSR1 every live runner of ``job_id`` under ``run_root`` (the agents' run
    directories' parent); return each runner log's last ``lines`` lines after the dump."""
    logs = sorted(run_root.glob(f"*/jobs/{job_id}/gen-*/runner.log"))
    asked = dump_stacks({path: pid for path in logs if (pid := runner_pid(path)) is not None})
    parts = []
    for path in logs:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        dumped = "stacks dumped" if path in asked else "no live runner"
        parts.append(f"--- {path.relative_to(run_root)} ({dumped})\n" + "\n".join(tail))
    return "\n".join(parts) if parts else f"(no runner log of {job_id} under {run_root})"
