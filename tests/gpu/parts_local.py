"""Parts 1, 4 and 6 of the GPU check: the `cuda` tests, the checkpoint stall, NCCL.

None of them needs a tidal cluster: each runs pytest or a worker of
tests/gpu as child processes with a deadline, and reads what they wrote
(pytest's JUnit XML, the workers' JSON), never their logs.
"""

from __future__ import annotations

import re
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from tests.gpu.context import NO_CUDA, Context, free_port, read_json
from tests.gpu.procs import Deadline, wait_for
from tests.gpu.report import PartResult

# -- 1. the cuda-marked tests ---------------------------------------------------------

CUDA_MARK = re.compile(r"pytest\.mark\.cuda\b")
#: Not here: the benchmarks (part 4 runs the GPU one) and this check itself.
NOT_TESTS = ("tests/bench/", "tests/gpu/")


def cuda_test_files(repo: Path) -> list[str]:
    """The test files that mark a test ``cuda``, wherever the tree has put them."""
    found = []
    for path in sorted((repo / "tests").rglob("test_*.py")):
        rel = path.relative_to(repo).as_posix()
        if not rel.startswith(NOT_TESTS) and CUDA_MARK.search(path.read_text(errors="replace")):
            found.append(rel)
    return found


def junit_cases(xml_path: Path) -> list[tuple[str, str, str]]:
    """(test id, outcome, message) for each test case of a JUnit XML file."""
    cases = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag != "skipped" else "skipped"
                message = child.get("message") or (child.text or "")[:300]
                break
        cases.append((name, outcome, message))
    return cases


def part_cuda_tests(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    files = cuda_test_files(ctx.repo)
    if not files:
        part.failed("collect", "no test file under tests/ marks a test cuda")
        return
    xml = ctx.out / "logs" / "cuda-tests.xml"
    argv = [ctx.python, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q",
            f"--junitxml={xml}", "--timeout", str(int(max(30, deadline.left() - 10))), *files]
    code = ctx.procs.run(argv, log_name="cuda-tests.log", timeout=deadline.left(), cwd=ctx.repo)
    if not xml.exists():
        part.failed("pytest", f"exit {code} and no JUnit report: "
                    f"{ctx.procs.log_tail('cuda-tests.log', 8)}")
        return
    cases = junit_cases(xml)
    part.ok("collect", f"{len(cases)} tests in {', '.join(files)}", tests=len(cases))
    for name, outcome, message in cases:
        short = name.rsplit(".", 1)[-1]
        if outcome == "passed":
            part.ok(short)
        elif outcome == "failed":
            part.failed(short, message)
        else:
            part.skipped(short, f"{message} ({NO_CUDA})" if ctx.dry_run else message)
    counts = {o: sum(1 for c in cases if c[1] == o) for o in ("passed", "failed", "skipped")}
    part.figures.update(counts)
    if code not in (0, 1):  # 1: a test failed (reported above); anything else: pytest itself
        part.failed("pytest", f"exit {code}: {ctx.procs.log_tail('cuda-tests.log', 8)}")


# -- 4. the checkpoint stall -------------------------------------------------------------

#: The run's size on a GPU: 3 sets (one warm-up) of 5 blocks of 16 steps, batch 16.
BENCH_GPU_ENV = {"BENCH_GPU_PAIRS": "2", "BENCH_GPU_BLOCK_STEPS": "16", "BENCH_GPU_BATCH": "16"}
#: The dry run: the code on the small model, in seconds.
BENCH_CPU_ENV = {"BENCH_GPU_PAIRS": "1", "BENCH_GPU_BLOCK_STEPS": "3", "BENCH_GPU_BATCH": "1"}
ROW = re.compile(r"^\|\s*(?P<mode>[^|]+?)\s*\|\s*(?P<median>-?[\d.]+)\s*\|[^|]*\|[^|]*\|"
                 r"\s*(?P<steps>-?[\d.]+)\s*\|\s*(?P<ratio>-?[\d.]+|nan|inf)\s*\|$")
STEP = re.compile(r"step time \(median[^)]*\): (?P<ms>[\d.]+) ms")


def parse_bench(lines: list[str]) -> tuple[float | None, dict[str, dict[str, float]]]:
    """The step time (ms) and, per mode, the time lost per save: seconds, steps, / sync."""
    step_ms = None
    rows: dict[str, dict[str, float]] = {}
    for line in lines:
        if (m := STEP.search(line)) is not None:
            step_ms = float(m["ms"])
        elif (m := ROW.match(line.strip())) is not None:
            rows[m["mode"]] = {"lost_s": float(m["median"]), "steps_lost": float(m["steps"]),
                               "vs_sync": float(m["ratio"])}
    return step_ms, rows


def part_checkpoint_stall(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    result = ctx.out / "logs" / "bench.json"
    argv = [ctx.python, "-m", "tests.gpu.worker_bench", str(result), str(ctx.work / "bench")]
    name = "steps lost per save, 200m model + AdamW on the GPU"
    if not ctx.cuda:
        part.skipped(name, NO_CUDA if ctx.dry_run else "no CUDA GPU")
        argv.append("--cpu")
        name = "the benchmark's code on the CPU, small model (a smoke run, not a figure)"
    env = ctx.procs.env(BENCH_GPU_ENV if ctx.cuda else BENCH_CPU_ENV)
    code = ctx.procs.run(argv, log_name="bench.log", timeout=deadline.left(), env=env,
                         cwd=ctx.repo)
    data = read_json(result)
    if code != 0 or data is None:
        part.failed(name, f"exit {code}: {ctx.procs.log_tail('bench.log', 8)}")
        return
    step_ms, rows = parse_bench(list(data["lines"]))
    if step_ms is None or not rows:
        part.failed(name, "the benchmark's table was not found in the lines it returned")
        return
    part.ok(name, f"step {step_ms:.1f} ms; " + "; ".join(
        f"{mode}: {row['steps_lost']:.1f} steps" for mode, row in rows.items()), step_ms=step_ms)
    for mode, row in rows.items():
        part.ok(mode, "" if ctx.cuda else "CPU smoke run", **row)
    if ctx.cuda:
        part.figures.update(step_ms=step_ms, **{
            f"steps_lost[{mode}]": row["steps_lost"] for mode, row in rows.items()})


# -- 6. NCCL -----------------------------------------------------------------------------

def _worker(ctx: Context, mode: str, tag: str, *extra: str) -> tuple[list[str], Path]:
    result = ctx.out / "logs" / f"nccl-{tag}.json"
    result.unlink(missing_ok=True)
    return [ctx.python, "-m", "tests.gpu.worker_nccl", mode, str(result), *extra], result


def _run_one(ctx: Context, part: PartResult, name: str, mode: str, deadline: Deadline,
             timeout: float, *extra: str) -> dict[str, Any] | None:
    argv, result = _worker(ctx, mode, mode, "--port", str(free_port()), *extra)
    try:
        code = ctx.procs.run(argv, log_name=f"nccl-{mode}.log", cwd=ctx.repo,
                             timeout=min(timeout, deadline.left()))
    except TimeoutError as exc:
        part.failed(name, f"{exc}; got as far as {(read_json(result) or {}).get('stages')}")
        return None
    data = read_json(result) or {}
    if code != 0 or "error" in data:
        tail = ctx.procs.log_tail(f"nccl-{mode}.log", 6)
        part.failed(name, f"exit {code}: {data.get('error') or tail}")
        return None
    return data


def _pair(ctx: Context, part: PartResult, name: str, mode: str, deadline: Deadline,
          *extra: str) -> list[dict[str, Any]] | None:
    """Ranks 0 and 1 of ``mode``; their results once both exited."""
    ports = ["--port", str(free_port()), "--port2", str(free_port())]
    runs = []
    for rank in (0, 1):
        argv, result = _worker(ctx, mode, f"{mode}-{rank}", *ports, "--rank", str(rank), *extra)
        runs.append((ctx.procs.start(argv, log_name=f"nccl-{mode}-{rank}.log", cwd=ctx.repo),
                     result))
    results = []
    for rank, (proc, result) in enumerate(runs):
        try:
            code = proc.wait(timeout=max(1.0, deadline.left()))
        except Exception:
            code = None
        ctx.procs.kill(proc)
        data = read_json(result) or {}
        if code != 0 or "error" in data:
            tail = ctx.procs.log_tail(f"nccl-{mode}-{rank}.log", 6)
            part.failed(name, f"rank {rank} exit {code}: {data.get('error') or tail}")
            for other, _ in runs:
                ctx.procs.kill(other)
            return None
        results.append(data)
    return results


def _abort_dead_peer(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    name = "abort of a collective blocked on a dead peer (2 GPUs)"
    ports = ["--port", str(free_port())]
    runs = []
    for rank in (0, 1):
        argv, result = _worker(ctx, "abort-dead-peer", f"dead-peer-{rank}", *ports,
                               "--rank", str(rank))
        runs.append((ctx.procs.start(argv, log_name=f"nccl-dead-peer-{rank}.log", cwd=ctx.repo),
                     result))
    (rank0, result0), (rank1, _) = runs
    try:
        wait_for(lambda: "blocked" in ((read_json(result0) or {}).get("stages") or []),
                 deadline=min(60.0, deadline.left()), what="rank 0 to block on its dead peer")
        rank1.wait(timeout=30)
        sent = time.monotonic()
        rank0.send_signal(signal.SIGTERM)  # what the runner sends
        code = rank0.wait(timeout=min(60.0, max(1.0, deadline.left())))
        took = time.monotonic() - sent
        if code == 75:
            part.ok(name, "SIGTERM -> the collective raised -> exit 75", unblock_s=took)
            part.figures["dead_peer_unblock_s"] = took
        else:
            part.failed(name, f"rank 0 ended with {code} after {took:.1f} s")
    except Exception as exc:
        part.failed(name, f"{type(exc).__name__}: {exc}")
    finally:
        for proc, _ in runs:
            ctx.procs.kill(proc)


LOST_NCCL = "the live path's NCCL abort: a lost notice, then a re-form (world size 1)"


def part_nccl(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    if not ctx.cuda:
        why = NO_CUDA if ctx.dry_run else "no CUDA GPU"
        for name in ("NCCL process group (1 rank)", "abort of a live NCCL group on SIGTERM",
                     "abort of a collective blocked on a dead peer (2 GPUs)",
                     "live re-form on NCCL (world size 1)", LOST_NCCL):
            part.skipped(name, why)
    else:
        data = _run_one(ctx, part, "NCCL process group (1 rank)", "group", deadline, 90)
        if data is not None:
            part.ok("NCCL process group (1 rank)", f"NCCL {data.get('nccl_version')}",
                    init_s=data["init_and_first_all_reduce_s"])
            part.figures["nccl_init_s"] = data["init_and_first_all_reduce_s"]
        name = "abort of a live NCCL group on SIGTERM (1 GPU: no peer to die)"
        data = _run_one(ctx, part, name, "abort-live", deadline, 90)
        if data is not None and "collective raised" in data["stages"]:
            part.ok(name, f"then a collective raised {data['error_type']}: "
                    f"{data.get('raised', '')[:120]}",
                    abort_s=data["abort_s"])
        elif data is not None:
            part.failed(name, f"stages {data['stages']}: {data.get('error', '')}")
        if ctx.machine.gpus >= 2:
            _abort_dead_peer(ctx, part, deadline)
        else:
            part.skipped("abort of a collective blocked on a dead peer (2 GPUs)",
                         f"needs 2 GPUs (NCCL refuses two ranks on one device); this machine "
                         f"has {ctx.machine.gpus}")
        name = "live re-form on NCCL (world size 1)"
        argv_port2 = ("--port2", str(free_port()))
        data = _run_one(ctx, part, name, "reform-nccl", deadline, 90, *argv_port2)
        if data is not None:
            part.ok(name, "rejoin into round 2, then an all-reduce",
                    reform_s=data["rejoin_and_all_reduce_s"])
            part.figures["reform_nccl_s"] = data["rejoin_and_all_reduce_s"]
        data = _run_one(ctx, part, LOST_NCCL, "lost-nccl", deadline, 90,
                        "--port2", str(free_port()))
        if data is not None and "round 2" in data["stages"]:
            part.ok(LOST_NCCL, f"lost notice -> the next collective raised "
                    f"{data['error_type']} -> rejoin into round 2, then an all-reduce",
                    abort_s=data["abort_s"], reform_s=data["rejoin_and_all_reduce_s"])
            part.figures["lost_abort_nccl_s"] = data["abort_s"]
        elif data is not None:
            part.failed(LOST_NCCL, f"stages {data['stages']}: {data.get('error', '')}")
    name = "live join: state transfer, 2 ranks over gloo, " + (
        "CUDA tensors" if ctx.cuda else "CPU tensors (dry run stand-in: no CUDA)")
    results = _pair(ctx, part, name, "transfer", deadline, *([] if ctx.cuda else ["--cpu"]))
    if results is None:
        return
    joiner = results[1]
    if not joiner["received"] or not joiner["equal"]:
        part.failed(name, f"rank 1 received={joiner['received']}, equal={joiner['equal']}, "
                    f"checksums {joiner['checksums']}")
        return
    wanted = "cuda:0" if ctx.cuda else "cpu"
    if joiner["state_devices"] != [wanted]:
        part.failed(name, f"the joiner's optimizer state is on {joiner['state_devices']}, "
                    f"not {wanted}")
        return
    part.ok(name, f"rank 1 got rank 0's step {joiner['step']} model and AdamW state "
            f"(on {wanted}), equal", join_s=results[0]["joined_s"], sync_s=joiner["sync_s"])
    if ctx.cuda:
        part.figures["transfer_sync_s"] = joiner["sync_s"]
