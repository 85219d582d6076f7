"""Drive tidal from Python: submit a job, print its logs as they come, wait for its end.

The same as ``tidal submit -- COMMAND`` typed by hand, written with
:class:`service.client.sync.Client`::

    python examples/client_submit.py                      # a hello-world job
    python examples/client_submit.py --nodes 2 -- python examples/mlp.py --steps 20

The coordinator is the one ``tidal`` uses: ``--url`` / ``TIDAL_URL`` and
``TIDAL_TOKEN`` (or ``TIDAL_TOKEN_FILE``), else the local cluster that
``tidal up`` started. It exits as ``tidal submit`` does: 0 when the job
succeeded, 1 when it failed, 3 when it was cancelled, and the error's own
code (4 refused, 5 unreachable, 6 not configured) otherwise.
"""

from __future__ import annotations

import argparse
import sys

from service.client import Client, TidalError

HELLO = ["python", "-c", "import os; print('hello from rank', os.environ['RANK'], 'of', "
         "os.environ['WORLD_SIZE'])"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", help="coordinator URL (default: TIDAL_URL or `tidal up`'s)")
    parser.add_argument("--name", default="hello", help="the job's name")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the job runs on")
    parser.add_argument("command", nargs="*", help="the job's command, after --")
    args = parser.parse_args(argv)
    try:
        with Client(args.url) as tidal:
            job = tidal.submit(name=args.name, command=args.command or HELLO,
                               min_nodes=args.nodes, max_restarts=0)
            print(f"submitted {job.job_id}", flush=True)
            # follow=True ends when the job has ended and its last lines are in.
            for line in tidal.logs(job.job_id, follow=True):
                print(line, flush=True)
            done = tidal.wait(job.job_id, timeout=60, check=True)
            step = f" at step {done.last_step}" if done.last_step is not None else ""
            print(f"{done.job_id} {done.phase.value}{step}")
            return 0
    except TidalError as exc:
        # check=True raises JobFailedError (exit 1) or JobCancelledError (3); the
        # coordinator's refusals are RefusedError (4), no answer UnavailableError (5).
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
