"""The job runner's entry point: ``python -m agent.runner_main SPEC.json``.

It does what needs no torch first, the working directory, the environment
and the start of the job's zygote (:mod:`agent.zygote`), and only then
imports :mod:`agent.runner` (torch elastic, about 1.5 s), so that the
zygote's imports and the runner's overlap.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from pydantic import SecretStr

from agent.lifeline import die_with_parent
from agent.netif import socket_interface_env
from agent.spec import RunnerSpec
from agent.zygote import ENV_SOCKET, ENV_SWITCH, ZygoteProcess


def prepare_environment(spec: RunnerSpec) -> Path:
    """Working directory and environment the workers inherit; returns the progress dir."""
    job = spec.assignment
    progress_dir = spec.job_dir / "progress"
    progress_dir.mkdir(parents=True, exist_ok=True)
    if job.cwd:
        os.chdir(job.cwd)
    os.environ.update(job.env)
    os.environ.update(
        {
            "TIDAL_JOB_ID": job.job_id,
            "TIDAL_NODE_ID": spec.node_id,
            "TIDAL_PROGRESS_DIR": str(progress_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if job.checkpoint_dir:
        os.environ["TIDAL_CHECKPOINT_DIR"] = job.checkpoint_dir
    # Collectives go over the interface other nodes reach this one at.
    os.environ.update(socket_interface_env(spec.address, job.env))
    return progress_dir



def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m agent.runner_main SPEC.json\n")
        return 2
    spec = RunnerSpec.model_validate_json(Path(argv[0]).read_text())
    # The password comes through the environment, never the spec file; the
    # workers inherit this process's environment, so take it out.
    password = os.environ.pop("TIDAL_ETCD_PASSWORD", None)
    spec = spec.model_copy(
        update={"etcd": spec.etcd.model_copy(update={"password": SecretStr(password)})}
        if password
        else {"etcd": spec.etcd.model_copy(update={"password": None})}
    )
    die_with_parent(expected_parent=spec.parent_pid)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s runner[{spec.assignment.job_id}] %(name)s: %(message)s",
    )
    progress_dir = prepare_environment(spec)
    zygote = None
    if spec.assignment.env.get(ENV_SWITCH) != "0":
        zygote = ZygoteProcess(os.getpid())  # imports torch beside us
        os.environ[ENV_SOCKET] = zygote.path
    try:
        from agent.runner import run  # torch: about 1.5 s

        return run(spec, progress_dir=progress_dir, zygote=zygote)
    finally:
        if zygote is not None:
            zygote.close()



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
