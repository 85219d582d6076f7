"""Tie a process's life to its parent's: the parent-death signal.

torch elastic starts every worker in a session of its own, so killing the
agent's process group does not reach the workers, and a SIGKILLed agent would
leave them training as orphans. Linux's ``PR_SET_PDEATHSIG`` makes the kernel
send a signal to a process when the thread that created it exits. tidal sets
it in every process it starts: the job runner (dies with the agent daemon) and
each worker, through :mod:`agent.workers.shim` (dies with its runner).

Caveat: the signal fires when the creating *thread* exits, so processes must
be started from a thread that lives as long as the parent (the main thread).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

from rendezvous.child import set_parent_death_signal

log = logging.getLogger(__name__)

def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    Args:
        expected_parent: the parent's pid as the parent knew it; if the parent
            already died before this call (we were re-parented), exit at once.
        sig: the signal to receive.

    Returns:
        True if the parent-death signal is set; False where it is not
        supported (not Linux), with a warning.
    """
    if not sys.platform.startswith("linux"):
        log.warning("parent-death signal not supported on %s: orphans are possible", sys.platform)
        return False
    if not set_parent_death_signal(sig):
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        # The parent died between our fork and the prctl: nobody will signal us.
        os._exit(128 + int(sig))
    return True
