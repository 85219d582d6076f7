"""The agent's run directory: where each job's generations, logs and reports lie.

One layout, built and parsed only here (the daemon, the runner, the metrics
collector and the log server all go through it)::

    RUN_DIR/jobs/<job>/gen-<generation>/   one runner of the job's assignment
        runner-spec.json                   what the daemon asked (agent.spec)
        runner.log                         the runner's own output
        runner-outcome.json                how it ended (agent.spec.OUTCOME_FILE)
        metrics.json                       its counters (agent.runner.status)
        progress/                          the workers' reports (checkpoints.progress,
                                           checkpoints.jit, checkpoints.live)
        logs/<run>/attempt_<k>/<local rank>/stdout.log, stderr.log   (torch elastic's)

A job id becomes a directory name: it is validated (:func:`rendezvous.keys.validate_id`)
before it is joined to the run directory.
"""

from __future__ import annotations

from pathlib import Path

from rendezvous.keys import validate_id

JOBS = "jobs"
GENERATION_PREFIX = "gen-"
RUNNER_SPEC = "runner-spec.json"
RUNNER_LOG = "runner.log"
PROGRESS = "progress"
LOGS = "logs"


def job_dir(run_dir: Path, job_id: str) -> Path:
    """``RUN_DIR/jobs/<job>``.

    Raises:
        InvalidIdentifierError: ``job_id`` is not a valid id.
    """
    return run_dir / JOBS / validate_id(job_id, what="job id")


def generation_dir(run_dir: Path, job_id: str, generation: int) -> Path:
    """Where the daemon runs a job's generation."""
    return job_dir(run_dir, job_id) / f"{GENERATION_PREFIX}{int(generation)}"


def generations(run_dir: Path, job_id: str) -> list[tuple[int, Path]]:
    """The job's generation directories under ``run_dir`` with their numbers, oldest first."""
    found = []
    for path in job_dir(run_dir, job_id).glob(f"{GENERATION_PREFIX}*"):
        suffix = path.name.removeprefix(GENERATION_PREFIX)
        if suffix.isdigit() and path.is_dir():
            found.append((int(suffix), path))
    return sorted(found)


def generation_dirs(run_dir: Path, job_id: str) -> list[Path]:
    """The job's generation directories under ``run_dir``, oldest first."""
    return [path for _, path in generations(run_dir, job_id)]


def progress_dir(generation: Path) -> Path:
    """A generation's progress directory (``TIDAL_PROGRESS_DIR`` of its workers)."""
    return generation / PROGRESS


def logs_dir(generation: Path) -> Path:
    """Where torch elastic writes a generation's worker logs."""
    return generation / LOGS
