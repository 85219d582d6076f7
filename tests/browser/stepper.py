"""A job for the web page's tests: reports a step every 0.2 s and logs a line for each.

No model, no process group: it runs at any world size until the agent stops
it (SIGTERM's default action). It never prints its environment: the tests put
a secret there and check that the page never shows it.
"""

from __future__ import annotations

import os
import time

from checkpoints.progress import create_progress_reporter


def main() -> None:
    reporter = create_progress_reporter(interval=0.2)
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    step = 0
    while True:
        step += 1
        reporter.record(step=step)
        print(f"step {step} on rank {rank} of {world}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
