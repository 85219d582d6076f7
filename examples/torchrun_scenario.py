"""Drive plain torchrun "nodes" through the etcd-v3 rendezvous: start, kill, join.

Each node is one ``torchrun --rdzv-backend=etcd-v3`` process (its own process
group) running :mod:`examples.elastic_ddp`; all nodes append step records to
one events file. The demo (``make demo``) and the integration tests use this
driver; the tests add their assertions on the records it collects.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
SCRIPT = Path(__file__).with_name("elastic_ddp.py")


def wait_until(condition: Callable[[], T], *, timeout: float, what: str) -> T:
    """Poll ``condition`` every 0.1 s until truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


@dataclass
class TorchrunCluster:
    """Plain torchrun nodes of one elastic job on loopback.

    Args:
        workdir: where checkpoints, logs and the events file go.
        etcd_endpoint: ``host:port`` of etcd.
        run_id: the rendezvous id (the job).
        nnodes: torchrun's ``--nnodes`` (``MIN:MAX``).
        rdzv_conf: extra ``--rdzv-conf`` (``key=value,...``); empty for tidal's defaults.
        step_seconds: pause between training steps.
    """

    workdir: Path
    etcd_endpoint: str
    run_id: str
    nnodes: str = "1:3"
    rdzv_conf: str = ""
    step_seconds: float = 0.2
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def events_path(self) -> Path:
        return self.workdir / "events.jsonl"

    @property
    def stop_file(self) -> Path:
        return self.workdir / "STOP"

    def command(self, name: str) -> list[str]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={self.etcd_endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            "--max-restarts=100",
            "--monitor-interval=0.2",
        ]
        if self.rdzv_conf:
            cmd.append(f"--rdzv-conf={self.rdzv_conf}")
        return [
            *cmd,
            str(SCRIPT),
            "--checkpoint", str(self.workdir / f"{name}.pt"),
            "--events", str(self.events_path),
            "--stop-file", str(self.stop_file),
            "--step-seconds", str(self.step_seconds),
            "--node-name", name,
        ]

    def start_node(self, name: str) -> subprocess.Popen[bytes]:
        """Start one torchrun node in its own process group."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                self.command(name),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.nodes[name] = proc
        return proc

    def kill_node(self, name: str) -> None:
        """SIGKILL a whole node: torchrun's process group and every worker under it.

        torch elastic starts each worker in a session of its own, so killing
        torchrun's process group alone would leave the workers running as
        orphans (still training with the others). A dead machine takes both.
        """
        proc = self.nodes[name]
        tree = descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)

    def records(self) -> list[dict[str, Any]]:
        """Every step record written so far, in file order."""
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                out.append(json.loads(line))
        return out

    def wait_for_world(
        self, nodes: set[str], world_size: int, *, after: float, timeout: float
    ) -> dict[str, Any]:
        """Wait until every node in ``nodes`` logged a step at ``world_size`` after ``after``.

        Returns the first such record (the moment the group trained at that size).
        """

        def seen() -> dict[str, Any] | None:
            for name in nodes:
                code = self.nodes[name].poll()
                if code is not None:
                    raise RuntimeError(
                        f"node {name} exited with code {code} while we waited; "
                        f"its log ends with:\n{self.log_tail(name)}"
                    )
            recent = [
                r for r in self.records() if r["time"] >= after and r["world_size"] == world_size
            ]
            if {r["node"] for r in recent} >= nodes:
                return recent[0]
            return None

        return wait_until(
            seen, timeout=timeout, what=f"nodes {sorted(nodes)} training at world size {world_size}"
        )

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the job to finish, wait for every node, and kill what is left."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        for proc in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill_all()

    def kill_all(self) -> None:
        for name in self.nodes:
            self.kill_node(name)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class ScenarioResult:
    """What the kill-and-join scenario observed."""

    records: list[dict[str, Any]]
    kill_to_first_step_s: float
    join_to_first_step_s: float
    last_step_before_kill: int
    first_step_after_kill: int
    first_step_after_join: int


def run_kill_and_join(cluster: TorchrunCluster, *, say: Callable[[str], None]) -> ScenarioResult:
    """Two nodes train; the first is SIGKILLed; the survivor goes on; a third joins.

    The caller owns cleanup (``cluster.kill_all()`` in a ``finally``).
    """
    t0 = time.time()
    say(f"starting node a: {' '.join(cluster.command('a')[:9])} ...")
    cluster.start_node("a")
    cluster.wait_for_world({"a"}, 1, after=t0, timeout=90)
    say("node a trains alone (world size 1); starting node b")
    cluster.start_node("b")
    first_two = cluster.wait_for_world({"a", "b"}, 2, after=t0, timeout=90)
    say(f"a and b train together at world size 2 (step {first_two['step']})")
    before = max(r["step"] for r in cluster.records())
    t_kill = time.time()
    say(f"SIGKILL node a (torchrun + worker; it created the rendezvous) at step {before}")
    cluster.kill_node("a")
    after_kill = cluster.wait_for_world({"b"}, 1, after=t_kill, timeout=90)
    kill_s = after_kill["time"] - t_kill
    say(f"b resumed alone at world size 1 from step {after_kill['step']} after {kill_s:.1f} s")
    t_join = time.time()
    say("starting node c")
    cluster.start_node("c")
    joined = cluster.wait_for_world({"b", "c"}, 2, after=t_join, timeout=90)
    join_s = joined["time"] - t_join
    say(f"b and c train at world size 2 from step {joined['step']} after {join_s:.1f} s")
    cluster.stop()
    say("stop file written; both nodes finished")
    return ScenarioResult(
        records=cluster.records(),
        kill_to_first_step_s=kill_s,
        join_to_first_step_s=join_s,
        last_step_before_kill=before,
        first_step_after_kill=int(after_kill["step"]),
        first_step_after_join=int(joined["step"]),
    )
