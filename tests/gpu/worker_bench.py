"""Part 4's worker: the checkpoint stall benchmark, loaded from its file, its table returned.

``python -m tests.gpu.worker_bench RESULT.json WORK_DIR [--cpu]`` loads
``tests/bench/bench_checkpoint_gpu.py`` by path (the size of the run comes from
its ``BENCH_GPU_*`` variables, set by the check), runs its ``run_benchmark`` on
GPU 0 with examples/charlm.py's ``200m`` model, or on the CPU with ``small``
(``--cpu``, a dry run: the code, not the figures), and writes the lines it
returns to ``RESULT.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

BENCH = Path("tests/bench/bench_checkpoint_gpu.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    import torch

    spec = importlib.util.spec_from_file_location("tests.bench.bench_checkpoint_gpu", BENCH)
    if spec is None or spec.loader is None:
        sys.exit(f"cannot load {BENCH}")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    if args.cpu:
        device, size = torch.device("cpu"), "small"
    else:
        device, size = torch.device("cuda", 0), "200m"
    args.work.mkdir(parents=True, exist_ok=True)
    lines = bench.run_benchmark(args.work, device, size)
    tmp = args.result.with_name(f".{args.result.name}.tmp")
    tmp.write_text(json.dumps({"lines": lines, "size": size, "device": str(device)}))
    os.replace(tmp, args.result)


if __name__ == "__main__":
    main()
