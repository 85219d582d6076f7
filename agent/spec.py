"""What the daemon hands a job runner, and what the runner's exit code means.

Kept apart from :mod:`agent.runner` so that the daemon, which only starts
runners, never imports torch.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agent.logcap import DEFAULT_MAX_BYTES
from rendezvous.client import EtcdConfig
from rendezvous.records import Assignment

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_STOPPED = 3  # stopped on request (SIGTERM): the node left the job


class RunnerSpec(BaseModel):
    """Everything a runner needs, written by the daemon as JSON next to the job's logs."""

    model_config = ConfigDict(extra="forbid")

    assignment: Assignment
    node_id: str
    address: str
    etcd: EtcdConfig
    job_dir: Path
    parent_pid: int
    log_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1024)
    # The TTL of the runner's rendezvous record: how long a hung or cut-off
    # node holds up the job's other nodes.
    lease_ttl_s: int = Field(default=5, ge=2, le=300)
