"""Start a worker command so that it dies with the process that started it.

torch elastic runs ``python -m agent.workers.shim -- ARGV...`` instead of the
job's command: the shim sets the parent-death signal (see
:mod:`agent.workers.lifeline`) and then ``exec``s the command unchanged, as a literal
argument vector (never through a shell). The signal survives ``exec``. It
first makes stdout and stderr append-only and private (0600), so that the
runner can cap the log files by copy-and-truncate (:mod:`agent.workers.logcap`),
and, where the agent names a worker user, becomes that user
(:mod:`agent.workers.user`) before it sets the signal (a change of user
clears it).

Where the runner's zygote (:mod:`agent.workers.zygote`) is ready and the command is
a Python script or module, the shim has the zygote fork the worker instead,
with torch already imported, and stays as the process torch watches: it
relays signals and exits with the worker's code.
"""

from __future__ import annotations

import os
import sys

from agent.workers.lifeline import die_with_parent
from agent.workers.logcap import reopen_for_append
from agent.workers.user import WorkerUserError, switch_from_env
from agent.workers.zygote import ENV_SOCKET, run_through

USAGE = "usage: python -m agent.workers.shim PARENT_PID -- COMMAND [ARG...]"


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write(USAGE + "\n")
        raise SystemExit(2)
    # While still the runner's user, which owns the log files: private, and
    # append-only so that the runner can cap them (agent.workers.logcap).
    reopen_for_append()
    try:
        switch_from_env()  # the agent's worker user, if it names one (agent.workers.user)
    except WorkerUserError as exc:
        sys.stderr.write(f"tidal: {exc}\n")
        raise SystemExit(126) from exc
    die_with_parent(expected_parent=int(argv[0]))  # after: a change of user clears it
    command = argv[2:]
    zygote = os.environ.pop(ENV_SOCKET, None)
    if zygote:  # a pre-started interpreter that has imported torch (agent.workers.zygote)
        code = run_through(zygote, command)
        if code is not None:
            raise SystemExit(code)
    try:
        os.execvp(command[0], command)  # noqa: S606  (an argv list, never a shell)
    except OSError as exc:
        sys.stderr.write(f"tidal: cannot run {command[0]!r}: {exc}\n")
        raise SystemExit(127) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
