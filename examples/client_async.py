"""Drive tidal from asyncio: a small sweep of jobs submitted at once, their logs
followed side by side, and a table of how each ended.

::

    python examples/client_async.py                  # three hello-world jobs
    python examples/client_async.py --values 0.1 0.3 -- python train.py --lr {}

Each value becomes one job whose command has ``{}`` replaced by it. The
coordinator is found as by ``tidal`` (``--url`` / ``TIDAL_URL``, ``TIDAL_TOKEN``,
else ``tidal up``'s cluster). Exits 0 when every job succeeded, else the exit
code of the first that did not (1 failed, 3 cancelled), or the error's own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from service.api.models import JobView
from service.client import AsyncClient, TidalError, exit_code

HELLO = ["python", "-c", "print('hello, value {}')"]


async def follow(tidal: AsyncClient, job: JobView, label: str) -> JobView:
    """Print the job's lines as they come, then its final view."""
    async for line in tidal.logs(job.job_id, follow=True):
        print(f"{label}: {line}", flush=True)
    return await tidal.wait(job.job_id, timeout=60)


async def sweep(url: str | None, values: list[str], command: list[str]) -> int:
    async with AsyncClient(url) as tidal:
        jobs = await asyncio.gather(*[
            tidal.submit(name=f"sweep-{i}", command=[w.replace("{}", v) for w in command],
                         max_restarts=0)
            for i, v in enumerate(values)
        ])
        for value, job in zip(values, jobs, strict=True):
            print(f"submitted {job.job_id} for {value}", flush=True)
        ended = await asyncio.gather(*[follow(tidal, job, value)
                                       for value, job in zip(values, jobs, strict=True)])
    print(f"{'VALUE':<8}  {'JOB':<24}  PHASE")
    for value, view in zip(values, ended, strict=True):
        print(f"{value:<8}  {view.job_id:<24}  {view.phase.value}")
    return next((code for view in ended if (code := exit_code(view))), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", help="coordinator URL (default: TIDAL_URL or `tidal up`'s)")
    parser.add_argument("--values", nargs="+", default=["a", "b", "c"],
                        help="one job per value, put where the command says {}")
    parser.add_argument("command", nargs="*", help="the jobs' command, after --")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(sweep(args.url, args.values, args.command or HELLO))
    except TidalError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
