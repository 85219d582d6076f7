"""Parts 2, 3 and 5 of the GPU check: GPUs through `tidal up`, step time, the restart path.

They share the run's ``tidal up`` (:meth:`Context.tidal`). What the workers saw
comes from files they write (tests/gpu/worker_*.py), the job's progress from
the API (``samples_per_second``, the rate the worker itself measures) or, under
plain torchrun, from the same worker's progress file (``TIDAL_PROGRESS_DIR``
set by hand: the file's format is :mod:`checkpoints.protocol.progress`'s).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from tests.gpu import compat
from tests.gpu.cluster import TidalUp
from tests.gpu.context import NO_CUDA, Context, read_json
from tests.gpu.procs import Deadline, wait_for
from tests.gpu.report import PartResult

# -- 2. tidal up with the GPU agent ---------------------------------------------------------

GPU_SERIES = ("tidal_agent_gpu_info", "tidal_agent_gpu_healthy", "tidal_agent_gpu_job")
GPU_READINGS = ("tidal_agent_gpu_utilization_ratio", "tidal_agent_gpu_memory_used_bytes",
                "tidal_agent_gpu_power_watts", "tidal_agent_gpu_temperature_celsius")


UUID = re.compile(r"^(gpu-)?[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _uuid(text: str) -> str | None:
    """A UUID as NVML ("GPU-...") or CUDA (without the prefix) writes it; None if it is not one."""
    text = text.strip().lower()
    return text.removeprefix("gpu-") if UUID.match(text) else None


def _env_of(env_dir: Path, job_id: str) -> dict[str, Any] | None:
    for path in sorted(env_dir.glob(f"{job_id}-*.json")):
        return read_json(path)
    return None


def _devices(cluster: TidalUp, job_id: str) -> list[int]:
    view = cluster.job(job_id)
    if view["phase"] != "RUNNING" or len(view["nodes"]) != 1:
        return []
    return list(view["nodes"][0]["devices"])


def _env_job(ctx: Context, cluster: TidalUp, name: str, gpus: int, env_dir: Path) -> str:
    command = ["python", "-m", "tests.gpu.worker_env", str(env_dir)]
    if ctx.cuda:
        command.append("--cuda")
    return cluster.submit({"name": name, "command": command, "gpus_per_node": gpus,
                           "grace_period_s": 2, "max_restarts": 0})


def _inventory(ctx: Context, part: PartResult, cluster: TidalUp, deadline: Deadline
               ) -> list[dict[str, Any]]:
    nodes = wait_for(lambda: [n for n in cluster.nodes() if n["gpu_devices"]] or None,
                     deadline=min(60.0, deadline.left()), what="the node to offer its GPUs")
    gpus = list(nodes[0]["gpu_devices"])
    name = "inventory through NVML" if ctx.cuda else (
        "inventory (dry run: --gpus-per-agent 1, indices without NVML)")
    models = sorted({g.get("model") or "?" for g in gpus})
    if ctx.cuda and not all(str(g.get("uuid") or "").startswith("GPU-") for g in gpus):
        part.failed(name, f"the agent's GPUs carry no NVML UUID: {gpus}")
    else:
        memory = [g.get("memory_bytes") or 0 for g in gpus]
        part.ok(name, f"{len(gpus)} GPU(s): {', '.join(models)}", gpus=len(gpus),
                healthy=sum(1 for g in gpus if g.get("healthy")),
                memory_gib=round(max(memory) / 2**30, 1) if any(memory) else None)
    return gpus


def _isolation(ctx: Context, part: PartResult, seen: dict[str, Any], held: list[int],
               gpus: list[dict[str, Any]]) -> None:
    name = "a GPU job placed and isolated (CUDA_VISIBLE_DEVICES)"
    visible = seen.get("CUDA_VISIBLE_DEVICES")
    problems = []
    if visible != ",".join(map(str, held)) or len(held) != 1:
        problems.append(f"CUDA_VISIBLE_DEVICES={visible!r}, the API says devices {held}")
    if seen.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        problems.append(f"CUDA_DEVICE_ORDER={seen.get('CUDA_DEVICE_ORDER')!r}")
    detail = f"devices {held}, CUDA_VISIBLE_DEVICES={visible}"
    if ctx.cuda:
        cuda = seen.get("cuda") or {}
        nvml = next((g for g in gpus if held and g["index"] == held[0]), {})
        if cuda.get("device_count") != 1:
            problems.append(f"the worker's CUDA sees {cuda.get('device_count')} devices")
        ours, theirs = _uuid(cuda.get("uuid") or ""), _uuid(nvml.get("uuid") or "")
        if ours and theirs and ours != theirs:
            problems.append(f"CUDA's device 0 is {cuda['uuid']}, NVML's GPU {held} is "
                            f"{nvml['uuid']}")
        detail += f"; CUDA sees 1 device, {cuda.get('name')} ({cuda.get('uuid') or 'no UUID'})"
    else:
        detail += " (dry run: no CUDA to ask which device that is)"
    if problems:
        part.failed(name, "; ".join(problems))
    else:
        part.ok(name, detail)


def _metrics(ctx: Context, part: PartResult, cluster: TidalUp, job_id: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(cluster.metrics()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    missing = [s for s in GPU_SERIES if s not in samples]
    holder = [s.labels.get("gpu") for s in samples.get("tidal_agent_gpu_job", [])
              if s.labels.get("job_id") == job_id]
    name = "GPU metrics scraped from the agent's /metrics"
    if missing or not holder:
        part.failed(name, f"missing {missing}; the job's GPU series: {holder}")
        return
    readings = {s: samples[s][0].value for s in GPU_READINGS if s in samples}
    part.ok(name, f"{', '.join(GPU_SERIES)}; the job holds GPU {holder[0]}",
            **{k.removeprefix("tidal_agent_gpu_"): v for k, v in readings.items()})
    reading_name = "GPU readings (utilization, memory, power, temperature)"
    if not ctx.cuda:
        part.skipped(reading_name, "dry run: no NVML, so no readings")
    elif len(readings) < len(GPU_READINGS):
        part.failed(reading_name, f"only {sorted(readings)} are exported")
    else:
        part.ok(reading_name, "read at scrape time from the last NVML poll")


def part_tidal_gpus(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    started = time.monotonic()
    cluster = ctx.tidal(deadline)
    part.ok("tidal up", f"coordinator at {cluster.url}", start_s=time.monotonic() - started)
    gpus = _inventory(ctx, part, cluster, deadline)
    env_dir = ctx.work / "env"
    env_dir.mkdir(parents=True, exist_ok=True)
    a = _env_job(ctx, cluster, "gpu-a", 1, env_dir)
    b = None
    try:
        seen = wait_for(lambda: _env_of(env_dir, a), deadline=min(150.0, deadline.left()),
                        what="job gpu-a's worker to start", alive=lambda: _ended(cluster, a))
        held = wait_for(lambda: _devices(cluster, a), deadline=min(30.0, deadline.left()),
                        what="the API to show gpu-a's devices")
        _isolation(ctx, part, seen, held, gpus)
        # The second job wants every GPU of the node: it cannot fit while gpu-a holds one.
        b = _env_job(ctx, cluster, "gpu-b", len(gpus), env_dir)
        view = wait_for(lambda: _unscheduled(cluster, b), deadline=min(30.0, deadline.left()),
                        what="the scheduler to leave gpu-b waiting")
        part.ok("a second job wanting the GPU waits", f"{view['phase']}: {view['reason']}")
        freed = time.monotonic()
        cluster.cancel(a)
        wait_for(lambda: _env_of(env_dir, b), deadline=min(150.0, deadline.left()),
                 what="gpu-b to start once gpu-a freed the GPU", alive=lambda: _ended(cluster, b))
        part.ok("it starts once the GPU is free", "gpu-a cancelled -> gpu-b's worker runs",
                seconds=time.monotonic() - freed)
        wait_for(lambda: _devices(cluster, b), deadline=min(30.0, deadline.left()),
                 what="the API to show gpu-b's devices")
        _metrics(ctx, part, cluster, b)
    finally:
        for job in (a, b):
            if job is not None:
                cluster.finish(job, Deadline(min(30.0, max(5.0, deadline.left()))))


def _ended(cluster: TidalUp, job_id: str) -> str | None:
    view = cluster.job(job_id)
    if view["phase"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
        error = (view.get("error") or {}).get("message", "")
        return f"job {job_id} ended {view['phase']} {error[-300:]}"
    return None


def _unscheduled(cluster: TidalUp, job_id: str) -> dict[str, Any] | None:
    view = cluster.job(job_id)
    for condition in view["conditions"]:
        if condition["type"] == "Scheduled" and not condition["status"]:
            if view["phase"] != "PENDING":
                return None
            return {"phase": view["phase"], "reason": condition.get("message")
                    or condition.get("reason")}
    return None


# -- 3. charlm under tidal against plain torchrun ------------------------------------------

#: Rates are read from this step on (cuDNN and the allocator settle before it on a GPU).
WARM_STEP = {True: 20, False: 5}
#: The 200m model (bf16 autocast) for the figure; the dry run's stand-in is tiny.
CHARLM_GPU = ["--size", "200m", "--total-steps", "250", "--global-batch-size", "16",
              "--warmup-steps", "10", "--corpus-bytes", "4000000", "--num-workers", "2"]
#: Some seconds of steps (the API shows a rate only while the job runs); one thread
#: (a tiny model's steps on a busy 2-core machine are otherwise all OpenMP contention).
CHARLM_CPU = ["--total-steps", "1000", "--n-layer", "1", "--d-model", "32", "--n-head", "2",
              "--block-size", "64", "--global-batch-size", "8", "--corpus-bytes", "100000",
              "--num-workers", "0", "--warmup-steps", "5"]
CPU_ENV = {"OMP_NUM_THREADS": "1"}


def charlm_args(ctx: Context) -> list[str]:
    common = ["--every-steps", "1000000", "--log-every", "10"]
    return [*(CHARLM_GPU if ctx.cuda else CHARLM_CPU), *common]


def _batch(args: list[str]) -> int:
    return int(args[args.index("--global-batch-size") + 1])


def _step_time(rates: dict[int, float], batch: int, warm: int) -> dict[str, float] | None:
    """Seconds per step from the rates read at steps >= ``warm``: median (and count)."""
    values = [batch / r for s, r in rates.items() if s >= warm and r and r > 0]
    if not values:
        return None
    return {"step_s": statistics.median(values), "readings": float(len(values))}


def _charlm_under_tidal(ctx: Context, cluster: TidalUp, deadline: Deadline
                        ) -> tuple[dict[str, float] | None, str]:
    args = charlm_args(ctx)
    job = cluster.submit({"name": "charlm", "command": ["python", "-m", "examples.charlm", *args],
                          "gpus_per_node": 1, "checkpoint_dir": "charlm", "max_restarts": 0,
                          "grace_period_s": 30, "env": {} if ctx.cuda else CPU_ENV})
    rates: dict[int, float] = {}

    def done() -> bool:
        view = cluster.job(job)  # a finished job still shows its workers' last report
        if view.get("last_step") is not None and view.get("samples_per_second"):
            rates[int(view["last_step"])] = float(view["samples_per_second"])
        if view["phase"] in ("FAILED", "CANCELLED"):
            error = (view.get("error") or {}).get("message", "")
            raise RuntimeError(f"the job ended {view['phase']}: {error[-300:]}")
        return bool(view["phase"] == "SUCCEEDED")

    try:
        wait_for(done, deadline=deadline, what="the charlm job to finish", interval=0.5,
                 fatal=(RuntimeError,))
    finally:
        cluster.finish(job, Deadline(30.0))
    return _step_time(rates, _batch(args), WARM_STEP[ctx.cuda]), job


def _charlm_under_torchrun(ctx: Context, deadline: Deadline) -> dict[str, float] | None:
    args = charlm_args(ctx)
    progress = ctx.work / "torchrun-progress"
    progress.mkdir(parents=True, exist_ok=True)
    env_names = compat.module("checkpoints.protocol.env", "rendezvous.worker_env")
    file_name = compat.name("checkpoints.protocol.progress", "rendezvous.progress_file",
                            "file_name")
    env = ctx.procs.env({env_names.PROGRESS_DIR: str(progress), **({} if ctx.cuda else CPU_ENV)})
    argv = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "examples.charlm", *args, "--checkpoint-dir", str(ctx.work / "charlm-torchrun")]
    if not ctx.cuda:
        argv += ["--device", "cpu"]
    proc = ctx.procs.start(argv, log_name="charlm-torchrun.log", env=env, cwd=ctx.repo)
    rates: dict[int, float] = {}
    report = progress / file_name(0)

    def read() -> None:
        data = read_json(report) or {}
        if data.get("step") is not None and data.get("samples_per_second"):
            rates[int(data["step"])] = float(data["samples_per_second"])

    def done() -> bool:
        exited = proc.poll() is not None
        read()
        return exited

    try:
        wait_for(done, deadline=deadline, what="torchrun's charlm to finish", interval=0.5)
    finally:
        ctx.procs.kill(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}: "
                           f"{ctx.procs.log_tail('charlm-torchrun.log', 8)}")
    return _step_time(rates, _batch(args), WARM_STEP[ctx.cuda])


def part_step_time(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    label = "examples/charlm.py --size 200m, bf16" if ctx.cuda else (
        "a tiny charlm on the CPU (dry run stand-in: the plumbing, not a figure)")
    if not ctx.cuda:
        part.skipped("charlm 200m step time on the GPU", NO_CUDA)
    cluster = ctx.tidal(deadline)
    half = Deadline(max(10.0, deadline.left() / 2))
    tidal, job = _charlm_under_tidal(ctx, cluster, half)
    warm = WARM_STEP[ctx.cuda]
    shutil.rmtree(cluster.checkpoint_root / "charlm", ignore_errors=True)  # 2.4 GB on a GPU
    if tidal is None:
        part.failed(f"under tidal: {label}", f"job {job} reported no rate after step {warm}")
    else:
        part.ok(f"under tidal: {label}", f"job {job}", **tidal)
    plain = _charlm_under_torchrun(ctx, deadline)
    shutil.rmtree(ctx.work / "charlm-torchrun", ignore_errors=True)
    if plain is None:
        part.failed(f"under plain torchrun: {label}",
                    f"the progress file had no rate after step {warm}")
    else:
        part.ok(f"under plain torchrun: {label}", "", **plain)
    if tidal and plain:
        ratio = tidal["step_s"] / plain["step_s"]
        part.ok("tidal / torchrun step time", "" if ctx.cuda else "CPU stand-in", ratio=ratio)
        if ctx.cuda:
            part.figures.update(tidal_step_s=tidal["step_s"], torchrun_step_s=plain["step_s"],
                                ratio=ratio)


# -- 5. the restart path ----------------------------------------------------------------------

RESTART_GPU = ["--size", "200m", "--batch", "16", "--save-at", "3"]
RESTART_CPU = ["--size", "small", "--batch", "2", "--block-size", "32", "--save-at", "3"]
BREAKDOWN = (("detect_and_spawn_s", "killed", "process_start"),
             ("imports_s", "process_start", "imports"),
             ("cuda_init_s", "imports", "cuda_init"),
             ("group_init_s", "cuda_init", "group_init"),
             ("model_build_s", "group_init", "model_built"),
             ("state_load_s", "model_built", "state_loaded"),
             ("first_step_s", "state_loaded", "first_step"),
             ("total_s", "killed", "first_step"))


def _marks(marks_dir: Path) -> list[dict[str, Any]]:
    found = [read_json(p) for p in sorted(marks_dir.glob("marks-*.json"))]
    return [m for m in found if m is not None]


def breakdown(marks: dict[str, Any], killed: float) -> dict[str, float]:
    """Seconds between the stages (a first start: from its process start)."""
    at = {**marks, "killed": killed}
    return {name: round(at[end] - at[start], 3) for name, start, end in BREAKDOWN
            if at.get(start) is not None and at.get(end) is not None}


def part_restart(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    name = "worker killed -> first step, 200m model on the GPU (NCCL)" if ctx.cuda else (
        "worker killed -> first step, small model on the CPU (dry run stand-in: gloo)")
    if not ctx.cuda:
        part.skipped("the restart path on the GPU", NO_CUDA)
    cluster = ctx.tidal(deadline)
    marks_dir = ctx.work / "restart-marks"
    marks_dir.mkdir(parents=True, exist_ok=True)
    command = ["python", "-m", "tests.gpu.worker_restart", str(marks_dir),
               *(RESTART_GPU if ctx.cuda else RESTART_CPU)]
    job = cluster.submit({"name": "restart", "command": command, "gpus_per_node": 1,
                          "checkpoint_dir": "restart", "max_restarts": 3, "grace_period_s": 5})
    try:
        first = wait_for(lambda: next((m for m in _marks(marks_dir) if "saved_step" in m), None),
                         deadline=Deadline(min(200.0, deadline.left())),
                         what="the first worker to save a checkpoint",
                         alive=lambda: _ended(cluster, job))
        part.ok("first start (nothing to restore)", f"saved step {first['saved_step']} in "
                f"{first['save_s']:.2f} s", **breakdown(first, first["process_start"]))
        killed = time.time()
        os.kill(int(first["pid"]), signal.SIGKILL)
        again = wait_for(lambda: next((m for m in _marks(marks_dir) if m["pid"] != first["pid"]),
                                      None),
                         deadline=deadline, what="the restarted worker's first step",
                         alive=lambda: _ended(cluster, job))
        figures = breakdown(again, killed)
        if again.get("resumed_step") != first["saved_step"]:
            part.failed(name, f"resumed at step {again.get('resumed_step')}, the checkpoint "
                        f"was of step {first['saved_step']}", **figures)
        else:
            part.ok(name, f"restart {again['restart_count']}, resumed at step "
                    f"{again['resumed_step']}, {again['backend']}", **figures)
            if ctx.cuda:
                part.figures.update(figures)
    finally:
        cluster.finish(job, Deadline(min(30.0, max(5.0, deadline.left()))))
    # The in-place path beside it, with members that keep their processes: part 7.
