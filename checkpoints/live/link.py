"""A worker's end of the live-resize files: its node's notices and its own state file.

:class:`WorkerLink` is what the checkpointer holds: the round this worker
last resized into, this rank's contribution to the agreement, the action at
an agreed round, the (bounded) wait for its node's notice, and its reports to
the runner. The files themselves are :mod:`checkpoints.protocol.live`; the
decisions, :mod:`checkpoints.live.decide`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from checkpoints.errors import LiveResizeError
from checkpoints.live.decide import Action, Flags, decide, pending_flags, pending_round
from checkpoints.live.group import RoundStore
from checkpoints.protocol.live import (
    RESIZE_NOTICE,
    LiveState,
    ResizeNotice,
    WorkerLive,
    read_leave_notice,
    read_resize_notice,
    worker_live_path,
    write_worker_live,
)

__all__ = ["LIVE_NOTICE_WAIT_S", "NoticeWatch", "WorkerLink", "wait_for_notice"]

log = logging.getLogger("checkpoints.live")  # the name it always logged under

#: How long a rank that must act waits for its own node's notice of the agreed round.
LIVE_NOTICE_WAIT_S = 30.0
_NOTICE_POLL_S = 0.02


def wait_for_notice(
    directory: Path,
    *,
    min_round: int,
    timeout: float = LIVE_NOTICE_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ResizeNotice:
    """Wait for this node's resize notice of ``min_round`` or later; return the newest.

    Raises:
        LiveResizeError: when none comes within ``timeout`` seconds.
    """
    deadline = clock() + timeout
    while True:
        notice = read_resize_notice(directory)
        if notice is not None and notice.round >= min_round:
            return notice
        if clock() >= deadline:
            seen = "none" if notice is None else f"round {notice.round}"
            raise LiveResizeError(
                f"no {RESIZE_NOTICE} of round {min_round} or later in {directory} after "
                f"{timeout:g} s (newest: {seen}): the ranks agreed to resize without this node"
            )
        sleep(_NOTICE_POLL_S)


class NoticeWatch:
    """Reads this node's resize notice again only when the file changed (one stat per step)."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / RESIZE_NOTICE
        self._directory = directory
        self._seen: tuple[int, int, int] | None = None
        self._notice: ResizeNotice | None = None

    def current(self) -> ResizeNotice | None:
        try:
            info = os.stat(self._path)
        except OSError:
            self._seen, self._notice = None, None
            return None
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key != self._seen:
            self._seen, self._notice = key, read_resize_notice(self._directory)
        return self._notice


class WorkerLink:
    """A worker's end of the files: its node's notices, its own ``live-<local_rank>.json``.

    Args:
        directory: the progress directory its runner watches.
        local_rank: this worker's local rank (its file's name).
    """

    def __init__(self, directory: Path, *, local_rank: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory, self.local_rank = directory, local_rank
        self.round = 0  # the round this worker last resized into
        self.host_said = 0  # the newest round a rank said it hosts (the last agreement)
        self._watch = NoticeWatch(directory)
        self._clock = clock
        self._seen: tuple[int, float] | None = None  # a notice's round, when first seen
        self._store: RoundStore | None = None  # the new group's, where this rank hosts it
        self._store_failed = 0  # the round whose store could not be opened early

    def flags(self, *, world_size: int) -> Flags:
        """This rank's contribution to the agreement (:func:`pending_flags`): a group that
        grows trains on until its joiners wait in the new group. Where this rank is the
        new rank 0, it opens the new group's store now (:class:`RoundStore`)."""
        notice = self._watch.current()
        if notice is None or pending_round(notice, self.round) == 0:
            return Flags(0, 0)
        if self._seen is None or self._seen[0] != notice.round:
            self._seen = (notice.round, self._clock())
        hosting = notice.ranks.get(self.local_rank) == 0
        grows = notice.world_size > world_size and not notice.lost
        waiting = False
        if hosting and grows:
            store = self._open_store(notice)
            waiting = store is None or store.joiners_waiting(notice.world_size - world_size)
        return pending_flags(
            notice, self.round, world_size=world_size, hosting=hosting,
            joiners_waiting=waiting, host_said=self.host_said,
            waited_s=self._clock() - self._seen[1],
        )

    def _open_store(self, notice: ResizeNotice) -> RoundStore | None:
        """The notice's round store, opened once (None: it cannot be: re-form at once)."""
        if self._store is not None and self._store.fits(notice):
            return self._store
        self._store = None  # an older round's: closed with its last reference
        if self._store_failed == notice.round:
            return None
        try:
            self._store = RoundStore.open(notice)
        except (RuntimeError, OSError) as exc:
            log.warning("cannot open the store of round %d on port %d early (%s): the group "
                        "re-forms at once", notice.round, notice.master_port, exc)
            self._store_failed = notice.round
        return self._store

    def take_store(self, notice: ResizeNotice) -> RoundStore | None:
        """The store this rank opened early for ``notice``'s round, handed over once
        (None: none, or another round's, which is closed)."""
        store, self._store = self._store, None
        return store if store is not None and store.fits(notice) else None

    def action(self, agreed_round: int) -> Action:
        """What to do now that the ranks agreed on ``agreed_round`` (:func:`decide`)."""
        notice = self._watch.current()
        return decide(
            agreed_round=agreed_round,
            current_round=self.round,
            leaving=read_leave_notice(self.directory) is not None,
            notice_round=None if notice is None else notice.round,
        )

    def lost_notice(self, *, timeout: float = LIVE_NOTICE_WAIT_S) -> ResizeNotice:
        """After a failed collective: this node's notice of the round that replaces the
        broken one (newer than this worker's, marked ``lost``; waits, bounded).

        Raises:
            LiveResizeError: when none comes within ``timeout`` seconds (the runner
                did not take the in-place path: it restarts the group).
        """
        deadline = time.monotonic() + timeout
        while True:
            notice = wait_for_notice(self.directory, min_round=self.round + 1,
                                     timeout=max(0.0, deadline - time.monotonic()))
            if notice.lost:
                return notice
            if time.monotonic() >= deadline:
                raise LiveResizeError(
                    f"the newest {RESIZE_NOTICE} (round {notice.round}) is a planned resize, "
                    f"not the recovery from a lost member: the runner restarts the group"
                )
            time.sleep(_NOTICE_POLL_S)

    def notice(self, agreed_round: int) -> ResizeNotice:
        """This node's notice of ``agreed_round`` or later (waits, bounded; see
        :func:`wait_for_notice`)."""
        return wait_for_notice(self.directory, min_round=agreed_round)

    def report(self, state: LiveState, *, step: int | None) -> None:
        """Tell the runner where this worker is (a failure to write is logged: the runner
        then does not see the worker as capable, or times out and restarts the group)."""
        live = WorkerLive(pid=os.getpid(), round=self.round, step=step, state=state)
        try:
            write_worker_live(self.directory, self.local_rank, live)
        except OSError as exc:
            log.warning("cannot report the live-resize state to the runner: %s", exc)

    def withdraw(self) -> None:
        """This worker can no longer resize (its checkpointer is closed): remove its file."""
        with contextlib.suppress(OSError):
            worker_live_path(self.directory, self.local_rank).unlink()
