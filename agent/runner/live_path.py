"""The runner's live path: resizing the worker group in place, and leaving it live.

When a node joins or announces that it leaves, or a member is lost (an
unplanned failure: the workers recover in place), and every local worker can
take the live path, :class:`agent.runner.elastic.TidalElasticAgent` forms the next
round while its workers train, writes them a resize notice
(:mod:`checkpoints.protocol.live`) and waits for them to re-form their process
group in it. On SIGTERM a leaving node announces its leave, writes its workers
a leave notice, and waits for them to exit once the others resized. What the
workers' answers mean (done, waiting, or the cause to fall back for) is
decided by the pure functions of :mod:`agent.runner.live_decide`; whether a change is taken
live, and what a failed attempt costs, by :mod:`agent.runner.restarts`. This module
carries those decisions out, as :class:`LivePath`, a mixin of the runner's
agent: it reads and sets the agent's state (torch's worker group and process
context, the runner's budget and grace) and falls back through the agent's
own restart steps.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState

from agent.runner import live_decide as live
from agent.runner import restarts
from agent.runner.restarts import Action
from agent.runner_metrics import LIVE, MEMBERSHIP_CHANGED, NOT_ANNOUNCED, NOT_CAPABLE, RESTART
from checkpoints.protocol.live import (
    ResizeNotice,
    WorkerLive,
    write_leave_notice,
    write_lost_notice,
    write_resize_notice,
)
from rendezvous.elastic.assigned_rounds import LEAVING, LOST, WAITING, Change

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import PContext

    from agent.runner.status import StatusReporter
    from rendezvous.elastic.assigned import AssignedRendezvousHandler

log = logging.getLogger("tidal.runner")

# A live resize (agent.runner.live_decide): how long the workers have to re-form their group
# (rdzv_conf "live_timeout"), how often the runner looks, and how much of the
# grace period a planned leave leaves to the restart path if it gives up.
LIVE_TIMEOUT_S = 60.0
# An in-place recovery: how long after the runner's lost notice every worker must
# have caught its failed collective. gloo raises within about 0.15 s of a killed
# peer's sockets closing; a worker still blocked after this is stuck on a peer
# that hangs without a FIN, which gloo cannot cut short: restart instead.
LOST_ACK_S = 2.0
LIVE_POLL_S = 0.02
LEAVE_MARGIN_S = 5.0
# Rounds one live resize forms at most: a member lost while a round is being taken
# makes the next one in place; more than that in a row goes the restart path.
LIVE_ROUNDS = 3
# A member's death the workers caught (a failed collective) but no ring reported yet,
# while the runner took a planned change: how long it waits for the loss to show up
# before it tells the workers a round that may still hold the dead member. A killed
# process's ring neighbours see it within milliseconds (34-61 ms seen under load).
INFERRED_LOSS_WAIT_S = 1.0


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


class LivePath:
    """The live path's actions, mixed into :class:`agent.runner.elastic.TidalElasticAgent`.

    Defines no torch hook: what it uses of the agent (torch's private members
    and the runner's own) is declared below for the type checker only, so
    that at run time nothing here shadows ``LocalElasticAgent``.
    """

    if TYPE_CHECKING:
        # torch's LocalElasticAgent (tests/unit/agent/runner/test_torch_coupling.py)
        _worker_group: WorkerGroup
        _pcontext: PContext | None
        _remaining_restarts: int
        _shutdown_timeout: int

        def _rendezvous(self, worker_group: WorkerGroup) -> None: ...

        # the runner's agent (agent.runner.elastic.TidalElasticAgent)
        _progress_dir: Path | None
        _live_timeout_s: float
        _resizing: bool
        _handler: AssignedRendezvousHandler
        _reporter: StatusReporter
        _budget: int
        _grace_s: float

        def _stop_broken_group(self) -> None: ...
        def _notice_recovery(self, at: float | None = None) -> None: ...
        def _report_running(self) -> None: ...
        def _start_group(self) -> None: ...

    def _live_blocker(self, *, lost: bool = False) -> str | None:
        """Why the group cannot take the live path now (a fallback cause), None if it can
        (``lost``: for an in-place recovery, :func:`agent.runner.live_decide.blocker`)."""
        group = self._worker_group
        if self._progress_dir is None or self._pcontext is None or (
            group.state != WorkerState.HEALTHY
        ):
            return NOT_CAPABLE
        return live.blocker(*self._local_workers(), alive, lost=lost)

    def _local_workers(self) -> tuple[dict[int, WorkerLive], list[int]]:
        """This node's workers' answers on the live path, and their local ranks."""
        assert self._progress_dir is not None
        local_ranks = [w.local_rank for w in self._worker_group.workers]
        return live.read_workers(self._progress_dir, local_ranks), local_ranks

    def _caught_failure(self) -> bool:
        """Whether a local worker caught a failed collective (a member of its group is
        lost), whatever change the runner saw first."""
        return self._progress_dir is not None and live.caught_failure(*self._local_workers())

    def _write_lost_notice(self, broken_round: int, now: float) -> None:
        """Tell the workers that round ``broken_round`` lost a member: their watchdog
        gets a collective blocked on the dead peer out."""
        assert self._progress_dir is not None
        try:
            write_lost_notice(self._progress_dir, round_=broken_round, now=now)
        except OSError as exc:
            log.warning("cannot write the live lost notice: %s", exc)

    def _live_resize(self, change: Change, members: frozenset[str], *,
                     lost: bool) -> frozenset[str]:
        """Form the next round with the workers running, and have them re-form their group.

        ``lost``: the round recovers from a member lost (a
        :data:`~rendezvous.elastic.assigned_rounds.LOST` change, or a planned one whose
        workers caught a failed collective first); a planned change during which a
        worker catches one becomes such a round too.
        Falls back to restarting the group (in the round just formed) when the
        workers do not all answer in time (:func:`agent.runner.restarts.after_live`).
        Returns the new round's members.
        """
        assert self._progress_dir is not None
        group = self._worker_group
        noticed_at, noticed = time.time(), time.monotonic()
        broken_round = self._handler.current_round()
        if lost:
            # First of all, so that a worker blocked on the dead peer hears of it.
            self._write_lost_notice(broken_round, noticed_at)
        log.info("node(s) %s %s: resizing the group live%s", ", ".join(sorted(change.nodes)),
                 {WAITING: "waiting to join", LOST: "lost"}.get(change.kind, "leaving"),
                 " (in place: the survivors keep their processes)" if lost else "")
        # Until it is decided: a SIGTERM meanwhile takes today's path (the flag
        # stays set when an exception leaves from here).
        self._resizing = True
        round_, new_members, outcome, lost = self._form_and_tell(
            broken_round, noticed if lost else None, members=members, change=change)
        step = restarts.after_live(LOST if lost else change.kind, self._budget, outcome)
        self._resizing = False
        reason = step.resize or "lost"
        if step.action is Action.LIVE:
            seconds = time.monotonic() - noticed
            log.info("the workers resized into round %d live in %.2f s", round_, seconds)
            self._reporter.count_resize(LIVE, reason, seconds=seconds)
            self._report_running()
            return new_members
        log.warning("the live resize into round %d did not complete (%s): restarting the group",
                    round_, step.fallback)
        self._notice_recovery(at=noticed_at)
        self._stop_broken_group()
        if step.rejoin:  # the round just formed is obsolete already
            self._rendezvous(group)
            new_members = self._handler.participants()
        self._reporter.count_restart(restarts.restart_reason(change.kind, members, new_members))
        self._reporter.count_resize(RESTART, reason, step.fallback)
        self._remaining_restarts -= 1  # the next attempt: see __init__
        self._start_group()
        return new_members

    def _form_and_tell(self, broken_round: int, lost_since: float | None, *,
                       members: frozenset[str], change: Change
                       ) -> tuple[int, frozenset[str], str, bool]:
        """Form the next round while the workers train, tell them, and wait for them.

        A member lost meanwhile makes the round in place (``lost``): a worker that
        caught a failed collective during a planned resize (the round formed is
        marked lost), or the round formed losing a member before the workers
        re-formed into it (the next one is formed, up to :data:`LIVE_ROUNDS` in all).
        A loss the workers caught but no ring reported yet, in a round that still
        holds every member but the leavers (:func:`agent.runner.live_decide.may_hold_the_dead`),
        is given :data:`INFERRED_LOSS_WAIT_S` to show up first: workers told a round
        with a dead member would wait for it in their group's store (60 s).
        Returns the round, its members, the outcome and whether it recovers from a loss.
        """
        group = self._worker_group
        ids = {w.local_rank: w.id for w in group.workers}
        observed = change.kind == LOST
        leaving = change.nodes if change.kind == LEAVING else frozenset()
        outcome = MEMBERSHIP_CHANGED
        for _ in range(LIVE_ROUNDS):
            self._rendezvous(group)  # the workers keep training meanwhile
            for worker in group.workers:  # the same processes, with new ranks
                worker.id = ids.get(worker.local_rank)
            new_members = self._handler.participants()
            round_ = self._handler.current_round()
            if lost_since is not None and not observed and self._dead_still_in(
                    members, new_members, leaving):
                observed = True
                continue
            outcome = self._tell_and_await(round_, lost_since=lost_since)
            if outcome == live.LOST_MEANWHILE:
                # A member of the old group died while this node took a planned change
                # (it saw the join or leave first): the workers wait for a round marked
                # lost. The round just formed is one, unless it still holds the dead.
                log.warning("a worker caught a failed collective during the planned resize "
                            "into round %d: a member is lost; the round is taken in place",
                            round_)
                lost_since = time.monotonic()
                self._write_lost_notice(broken_round, time.time())
                if not observed and self._dead_still_in(members, new_members, leaving):
                    observed, outcome = True, MEMBERSHIP_CHANGED
                    continue
                outcome = self._tell_and_await(round_, lost_since=lost_since)
            pending = self._handler.pending_change() if outcome == MEMBERSHIP_CHANGED else None
            if pending is None or pending.kind != LOST or self._live_blocker(lost=True):
                break
            # The round formed lost a member before the workers re-formed into it (one
            # that died a moment after the round was decided): recover into the next.
            log.warning("round %d lost node(s) %s before the workers re-formed into it: "
                        "forming the next round in place", round_, ", ".join(sorted(pending.nodes)))
            lost_since = lost_since or time.monotonic()
            observed = True
            self._write_lost_notice(broken_round, time.time())
        return round_, new_members, outcome, lost_since is not None

    def _dead_still_in(self, members: frozenset[str], new_members: frozenset[str],
                       leaving: frozenset[str]) -> bool:
        """The workers caught a member's death that no change reported: whether the
        round just formed holds it (its loss shows up within :data:`INFERRED_LOSS_WAIT_S`;
        the next round is then to be formed). Logs what it found."""
        if not live.may_hold_the_dead(members, new_members, leaving):
            return False
        deadline = time.monotonic() + INFERRED_LOSS_WAIT_S
        while time.monotonic() < deadline:
            pending = self._handler.pending_change()
            if pending is not None and pending.kind == LOST:
                log.warning("the round formed holds node(s) %s, lost: forming the next round "
                            "in place", ", ".join(sorted(pending.nodes)))
                return True
            time.sleep(LIVE_POLL_S)
        return False

    def _tell_and_await(self, round_: int, *, lost_since: float | None = None) -> str:
        """Tell the workers round ``round_``; wait until they resized into it (bounded).

        ``lost_since``: the round recovers from a member lost, noticed then
        (monotonic): the notice says so, and every worker must have caught
        its failed collective :data:`LOST_ACK_S` after it.

        Returns :data:`agent.runner.live_decide.DONE` or the cause to fall back for.
        """
        assert self._progress_dir is not None and self._pcontext is not None
        group = self._worker_group
        notice = ResizeNotice(
            round=round_, master_addr=str(group.master_addr),
            master_port=int(group.master_port or 0),
            world_size=group.workers[0].world_size if group.workers else 0,
            ranks={w.local_rank: w.global_rank for w in group.workers}, written_at=time.time(),
            group_rank=group.group_rank, group_world_size=group.group_world_size,
            lost=lost_since is not None,
        )
        try:
            write_resize_notice(self._progress_dir, notice)
        except OSError as exc:
            log.warning("cannot write the live resize notice: %s", exc)
            return NOT_CAPABLE
        log.info("told the workers round %d (world size %d)", round_, notice.world_size)
        deadline = time.monotonic() + self._live_timeout_s
        ack_deadline = lost_since + LOST_ACK_S if lost_since is not None else None
        while True:
            change = self._handler.pending_change()
            outcome = live.resize_outcome(
                *self._local_workers(), round_,
                exited=not all(alive(pid) for pid in self._pcontext.pids().values()),
                superseded=change is not None and change.kind not in restarts.PLANNED,
                now=time.monotonic(), deadline=deadline, ack_deadline=ack_deadline,
                planned=lost_since is None,
            )
            if outcome != live.WAITING:
                return outcome
            time.sleep(LIVE_POLL_S)

    def _leave_live(self) -> None:
        """SIGTERM (a planned leave): let the others resize without this node, if they can.

        Announces the leave in the rendezvous, tells the workers, and waits
        (bounded by the grace period less :data:`LEAVE_MARGIN_S`) for them to
        exit once the others resized. Returns either way: then the group is
        shut down as on any SIGTERM (at once if the workers are gone) and the
        node leaves the rendezvous. A group that cannot take the live path
        announces the leave too, and goes today's way at once.
        """
        if self._resizing or self._progress_dir is None:
            return
        cause = self._live_blocker()
        if cause is not None:
            # Said all the same: the others restart their group as a healthy one
            # (with the grace to save), for a leave, instead of as a broken one
            # once this node is gone.
            self._handler.announce_leaving()
            self._reporter.count_resize(RESTART, "leave", cause)
            return
        # The outcome is decided: another SIGTERM must not cut the wait short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        started = time.monotonic()
        bound = max(1.0, min(self._live_timeout_s, self._grace_s - LEAVE_MARGIN_S))
        outcome = NOT_ANNOUNCED
        if self._handler.announce_leaving():
            try:
                write_leave_notice(self._progress_dir, now=time.time())
            except OSError as exc:
                log.warning("cannot write the live leave notice: %s", exc)
                outcome = NOT_CAPABLE
            else:
                outcome = self._await_left(started + bound)
        waited = time.monotonic() - started
        if outcome == live.DONE:
            log.info("the workers left the group live in %.2f s", waited)
            self._reporter.count_resize(LIVE, "leave", seconds=waited)
            return
        log.warning("the live leave did not complete (%s): stopping the workers", outcome)
        self._reporter.count_resize(RESTART, "leave", outcome)
        self._shutdown_timeout = max(1, int(self._grace_s - waited))

    def _await_left(self, deadline: float) -> str:
        """Wait until every worker exited having left its group (or why not)."""
        assert self._progress_dir is not None and self._pcontext is not None
        pids = self._pcontext.pids()
        while True:
            outcome = live.leave_outcome(
                live.read_workers(self._progress_dir, pids), pids, alive,
                peers_stay=bool(self._handler.staying_peers()), now=time.monotonic(),
                deadline=deadline,
            )
            if outcome != live.WAITING:
                return outcome
            time.sleep(LIVE_POLL_S)
