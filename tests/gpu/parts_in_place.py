"""Part 7 of the GPU check: a lost node recovered in place, beside the restart path, on a GPU.

tidal's in-place recovery (#25) keeps the survivors' processes when a member
dies, so on a GPU they keep their CUDA context, their model on the device and
their communicators; the restart path pays all of it again. One GPU cannot hold
two NCCL ranks (NCCL refuses two ranks on one device), so this part runs the
recovery benchmark (tests/bench/bench_recovery_in_place.py) with three members
that share GPU 0: the model, the optimizer and the data on the GPU, the
gradients over gloo (which takes CUDA tensors). It is what the in-place path
costs with CUDA state in the workers, not the NCCL path, which needs two GPUs.

The benchmark prints one line per kill (``in-place kill 1: recovery 0.18 s
{...breakdown...}``) and a table; this part reads the lines. The dry run (no
CUDA) runs one in-place kill of a small model on the CPU: the plumbing, not a
figure.
"""

from __future__ import annotations

import ast
import re
import statistics
from typing import Any

from tests.gpu.context import NO_CUDA, Context
from tests.gpu.procs import Deadline
from tests.gpu.report import PartResult

#: The model on a GPU: 21M float32 parameters (84 MB), Adam's state twice that.
GPU_MODEL = "--features 1024 --hidden 4096 --dtype float32"
KILL = re.compile(r"^(?P<path>in-place|restart) kill (?P<n>\d+): recovery (?P<s>[\d.]+) s "
                  r"(?P<parts>\{.*\})$")


def parse_kills(lines: list[str]) -> dict[str, list[tuple[float, dict[str, float]]]]:
    """Per path, each kill's recovery (s) and, in place, its breakdown (s)."""
    kills: dict[str, list[tuple[float, dict[str, float]]]] = {}
    for line in lines:
        m = KILL.match(line.strip())
        if m is not None:
            parts = ast.literal_eval(m["parts"])
            kills.setdefault(m["path"], []).append(
                (float(m["s"]), {k: float(v) for k, v in parts.items()}))
    return kills


def summary(kills: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Median and worst recovery; the in-place breakdown's medians."""
    values = [s for s, _ in kills]
    out: dict[str, float] = {"kills": len(values), "p50_s": round(statistics.median(values), 3),
                             "max_s": round(max(values), 3)}
    breakdowns = [b for _, b in kills if b]
    for name in breakdowns[0] if breakdowns else ():
        out[f"{name}_s"] = round(statistics.median(b[name] for b in breakdowns), 3)
    return out


def part_in_place(ctx: Context, part: PartResult, deadline: Deadline) -> None:
    if ctx.cuda:
        env = {"BENCH_IN_PLACE_DEVICE": "cuda", "BENCH_IN_PLACE_MODEL": GPU_MODEL,
               "BENCH_IN_PLACE_KILLS": "3", "BENCH_IN_PLACE_PATHS": "in-place,restart"}
        label = "3 members sharing the GPU (gloo), 21M-parameter MLP on the GPU"
    else:
        part.skipped("a lost node on the GPU, in place and restarted", NO_CUDA)
        env = {"BENCH_IN_PLACE_DEVICE": "cpu", "BENCH_IN_PLACE_KILLS": "1",
               "BENCH_IN_PLACE_PATHS": "in-place"}
        label = "3 members on the CPU, small MLP (dry run stand-in: the plumbing, not a figure)"
    argv = [ctx.python, "-m", "pytest", "tests/bench/bench_recovery_in_place.py", "-m", "bench",
            "-s", "-q", "-p", "no:cacheprovider", "--timeout", str(int(deadline.left()))]
    code = ctx.procs.run(argv, log_name="in-place.log", timeout=deadline.left(),
                         env=ctx.procs.env(env), cwd=ctx.repo)
    lines = (ctx.out / "logs" / "in-place.log").read_text(errors="replace").splitlines()
    kills = parse_kills(lines)
    if code != 0 or not kills.get("in-place"):
        part.failed(label, f"exit {code}, kills measured {kills}: "
                    f"{ctx.procs.log_tail('in-place.log', 10)}")
        return
    figures: dict[str, Any] = {}
    for path, measured in kills.items():
        row = summary(measured)
        part.ok(f"{path}: node SIGKILLed -> first step at world size 2", label, **row)
        figures.update({f"{path}_{k}": v for k, v in row.items() if k != "kills"})
    if "restart" in kills:
        ratio = figures["in-place_p50_s"] / figures["restart_p50_s"]
        part.ok("in place / restart, median recovery", "", ratio=round(ratio, 3))
        figures["ratio"] = round(ratio, 3)
    if ctx.cuda:
        part.figures.update(figures)
