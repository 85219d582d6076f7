"""A stand-in worker for the runner's live path: speaks checkpoints.protocol.live, trains nothing.

``python -m tests.support.live_standin MODE [FAIL_FROM]``, run by a tidal
runner as a job's command. It announces the live path (``ready``) unless MODE
is ``plain``; on a resize notice of a newer round it answers ``resized``, or
exits 3 if the round is FAIL_FROM or later (a worker that dies in the live
path). MODE ``broken``: a planned (not ``lost``) notice of round FAIL_FROM or
later is answered ``broken``, as by a worker whose collective failed at that
moment (a member died during a planned change), and only a notice marked
``lost`` then gets ``resized``. On a leave notice it says ``left`` and exits 77 once a worker of
another node acts on a newer round (the files the glob in ``STANDIN_PEERS``
finds; at once without it), as a worker on the checkpoints library leaves at
the step where its group agreed to resize.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path

from checkpoints.protocol.live import (
    EXIT_LEFT,
    LiveState,
    WorkerLive,
    read_leave_notice,
    read_resize_notice,
    write_worker_live,
)


def _peers_moved_past(current: int, own: Path) -> bool:
    """Whether a worker of another node acts on a round after ``current``."""
    pattern = os.environ.get("STANDIN_PEERS")
    if not pattern:
        return True
    for name in glob.glob(pattern):
        if Path(name).parent == own:
            continue
        try:
            live = WorkerLive.from_json(json.loads(Path(name).read_text()))
        except (OSError, ValueError):
            continue
        if live.round > current and live.state in (LiveState.RESIZING, LiveState.RESIZED):
            return True
    return False


def main(mode: str, fail_from: int) -> int:
    directory = Path(os.environ["TIDAL_PROGRESS_DIR"])
    local_rank = int(os.environ["LOCAL_RANK"])
    pid = os.getpid()
    current = 0
    if mode != "plain":
        write_worker_live(directory, local_rank, WorkerLive(pid, 0, None, LiveState.READY))
    while True:
        notice = read_resize_notice(directory)
        if mode == "broken" and notice is not None and notice.round > current and (
            notice.round >= fail_from and not notice.lost
        ):
            write_worker_live(directory, local_rank, WorkerLive(pid, current, 0, LiveState.BROKEN))
        elif mode != "plain" and notice is not None and notice.round > current:
            write_worker_live(directory, local_rank,
                              WorkerLive(pid, notice.round, 0, LiveState.RESIZING))
            if mode == "answer" and notice.round >= fail_from:
                return 3
            current = notice.round
            write_worker_live(directory, local_rank,
                              WorkerLive(pid, current, 0, LiveState.RESIZED))
        elif mode != "plain" and read_leave_notice(directory) is not None and (
            _peers_moved_past(current, directory)
        ):
            write_worker_live(directory, local_rank, WorkerLive(pid, current, 0, LiveState.LEFT))
            return EXIT_LEFT
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else sys.maxsize))
