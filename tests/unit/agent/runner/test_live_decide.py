"""The runner's side of a live resize: its files and its decisions (agent.runner.live_decide)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agent.runner import live_decide as live
from agent.runner_metrics import (
    FALLBACK_CAUSES,
    MEMBERSHIP_CHANGED,
    NO_PEER_STAYS,
    NOT_CAPABLE,
    TIMEOUT,
    WORKER_EXITED,
)
from checkpoints.live import LiveState, WorkerLive, write_worker_live

ALIVE = {101, 102}


def alive(pid: int) -> bool:
    return pid in ALIVE


def worker(pid: int, state: LiveState = LiveState.READY, round_: int = 0,
           step: int | None = 5) -> WorkerLive:
    return WorkerLive(pid=pid, round=round_, step=step, state=state)


def test_the_runner_reads_its_own_workers_answers_only(tmp_path: Path) -> None:
    write_worker_live(tmp_path, 0, worker(101, LiveState.RESIZED, 2, 40))
    write_worker_live(tmp_path, 1, worker(102))
    write_worker_live(tmp_path, 5, worker(105))  # not one of this group's local ranks
    (tmp_path / "live-2.json").write_text("{half")
    assert live.read_workers(tmp_path, [0, 1, 2]) == {
        0: worker(101, LiveState.RESIZED, 2, 40), 1: worker(102)}


def test_a_group_is_live_capable_only_when_every_local_worker_announced_it_alive() -> None:
    ready = {0: worker(101), 1: worker(102, LiveState.RESIZED, 2)}
    assert live.blocker(ready, [0, 1], alive) is None
    assert live.blocker({0: worker(101)}, [0, 1], alive) == NOT_CAPABLE  # no file: no library
    assert live.blocker({**ready, 1: worker(999)}, [0, 1], alive) == NOT_CAPABLE  # a dead pid
    assert live.blocker({**ready, 1: worker(102, LiveState.RESIZING)}, [0, 1], alive) is not None
    assert live.blocker({**ready, 1: worker(102, LiveState.LEFT)}, [0, 1], alive) is not None
    assert live.blocker({}, [], alive) == NOT_CAPABLE


def test_after_a_member_is_lost_a_worker_already_waiting_for_the_next_round_is_capable() -> None:
    # It caught the failed collective first and said "resizing": in place it can go on.
    waiting = {0: worker(101), 1: worker(102, LiveState.RESIZING)}
    assert live.blocker(waiting, [0, 1], alive, lost=True) is None
    assert live.blocker(waiting, [0, 1], alive) == NOT_CAPABLE
    assert live.blocker({0: worker(101)}, [0, 1], alive, lost=True) == NOT_CAPABLE
    assert live.blocker({**waiting, 1: worker(102, LiveState.LEFT)}, [0, 1], alive,
                        lost=True) == NOT_CAPABLE
    assert live.blocker({**waiting, 1: worker(999, LiveState.RESIZING)}, [0, 1], alive,
                        lost=True) == NOT_CAPABLE


def outcome(workers: dict[int, WorkerLive], *, exited: bool = False, superseded: bool = False,
            now: float = 0.0) -> str:
    return live.resize_outcome(workers, [0, 1], 3, exited=exited, superseded=superseded,
                               now=now, deadline=10.0)


def test_a_live_resize_is_done_once_every_worker_resized_into_the_round() -> None:
    resized, resizing = LiveState.RESIZED, LiveState.RESIZING
    assert outcome({0: worker(101, resized, 3), 1: worker(102, resized, 4)}) == live.DONE
    assert outcome({0: worker(101, resized, 3), 1: worker(102, resizing, 2)}) == live.WAITING
    # resized into an older round: not this one yet
    assert outcome({0: worker(101, resized, 3), 1: worker(102, resized, 2)}) == live.WAITING
    assert outcome({0: worker(101, resized, 3)}) == live.WAITING


def test_an_in_place_recovery_gives_up_on_a_worker_still_blocked_at_the_ack_deadline() -> None:
    resized, resizing, ready = LiveState.RESIZED, LiveState.RESIZING, LiveState.READY

    def lost(workers: dict[int, WorkerLive], now: float) -> str:
        return live.resize_outcome(workers, [0, 1], 3, exited=False, superseded=False,
                                   now=now, deadline=10.0, ack_deadline=2.0)

    # Both caught the failed collective: waited for until the deadline.
    assert lost({0: worker(101, resizing, 2), 1: worker(102, resized, 3)}, 5.0) == live.WAITING
    # One still blocked in it (a peer hanging, no FIN): given up on at the ack deadline.
    blocked = {0: worker(101, resizing, 2), 1: worker(102, ready)}
    assert lost(blocked, 1.9) == live.WAITING
    assert lost(blocked, 2.0) == TIMEOUT
    assert lost({0: worker(101, resized, 3), 1: worker(102, resized, 2)}, 2.0) == TIMEOUT
    assert lost({0: worker(101, resized, 3), 1: worker(102, resized, 3)}, 9.0) == live.DONE


def test_a_live_resize_falls_back_on_an_exit_another_change_or_its_deadline() -> None:
    pending = {0: worker(101, LiveState.RESIZING, 2), 1: worker(102, LiveState.READY)}
    assert outcome(pending, exited=True) == WORKER_EXITED
    assert outcome(pending, superseded=True) == MEMBERSHIP_CHANGED
    assert outcome(pending, now=10.0) == TIMEOUT
    assert outcome(pending, now=9.99) == live.WAITING
    done = {0: worker(101, LiveState.RESIZED, 3), 1: worker(102, LiveState.RESIZED, 3)}
    assert outcome(done, exited=True, now=11.0) == live.DONE  # the answers came first


def test_a_planned_leave_is_done_once_every_worker_left_and_exited() -> None:
    pids = {0: 101, 1: 102}

    def leave(workers: dict[int, WorkerLive], gone: set[int], now: float = 0.0,
              peers_stay: bool = True) -> str:
        return live.leave_outcome(workers, pids, lambda pid: pid not in gone,
                                  peers_stay=peers_stay, now=now, deadline=5.0)

    left = {0: worker(101, LiveState.LEFT), 1: worker(102, LiveState.LEFT)}
    assert leave(left, {101, 102}) == live.DONE
    assert leave(left, {101}) == live.WAITING  # the other is on its way out
    assert leave({0: worker(101), 1: worker(102)}, set()) == live.WAITING
    assert leave({0: worker(101), 1: worker(102, LiveState.LEFT)}, {101}) == WORKER_EXITED
    assert leave({0: worker(101), 1: worker(102)}, set(), now=5.0) == TIMEOUT
    # Every other member leaves too (a cancel): nobody will resize, do not wait.
    assert leave({0: worker(101), 1: worker(102)}, set(), peers_stay=False) == NO_PEER_STAYS
    # ... unless the workers are on their way out already: the others resized.
    assert leave({0: worker(101, LiveState.LEFT), 1: worker(102)}, {101},
                 peers_stay=False) == live.WAITING


@given(st.dictionaries(st.integers(0, 3), st.sampled_from(
    list(LiveState)), max_size=4),
    st.booleans(), st.booleans(), st.floats(0, 20), st.booleans())
def test_a_live_resize_waits_only_before_its_deadline_and_only_while_nothing_went_wrong(
    states: dict[int, LiveState], exited: bool, superseded: bool, now: float, planned: bool
) -> None:
    workers = {lr: worker(100 + lr, s, 3) for lr, s in states.items()}
    result = live.resize_outcome(workers, [0, 1, 2, 3], 3, exited=exited,
                                 superseded=superseded, now=now, deadline=10.0, planned=planned)
    assert result in (live.DONE, live.WAITING, live.LOST_MEANWHILE, *FALLBACK_CAUSES)
    assert (result == live.LOST_MEANWHILE) == (
        planned and not exited and not superseded and result != live.DONE
        and LiveState.BROKEN in states.values())
    if result == live.WAITING:
        assert not exited and not superseded and now < 10.0
    assert (result == live.DONE) == (
        len(states) == 4 and all(s == LiveState.RESIZED for s in states.values()))



def test_a_worker_that_caught_a_failed_collective_can_recover_in_place_but_not_resize_planned(
) -> None:
    broken = {0: worker(101), 1: worker(102, LiveState.BROKEN)}
    assert live.caught_failure(broken, [0, 1])
    assert not live.caught_failure({0: worker(101), 1: worker(102, LiveState.RESIZING)}, [0, 1])
    assert live.blocker(broken, [0, 1], alive, lost=True) is None
    assert live.blocker(broken, [0, 1], alive) == NOT_CAPABLE


def test_a_planned_resize_that_meets_a_failed_collective_turns_into_a_loss() -> None:
    broken = {0: worker(101, LiveState.BROKEN, 2), 1: worker(102, LiveState.READY)}

    def planned(workers: dict[int, WorkerLive], **kw: bool) -> str:
        return live.resize_outcome(workers, [0, 1], 3, exited=kw.get("exited", False),
                                   superseded=kw.get("superseded", False), now=0.0,
                                   deadline=10.0, planned=True)

    assert planned(broken) == live.LOST_MEANWHILE
    # A worker gone or the round obsolete: the fallback, as before.
    assert planned(broken, exited=True) == WORKER_EXITED
    assert planned(broken, superseded=True) == MEMBERSHIP_CHANGED
    # Once marked lost, "broken" is what the runner waits for (until the ack deadline).
    assert live.resize_outcome(broken | {1: worker(102, LiveState.BROKEN, 2)}, [0, 1], 3,
                               exited=False, superseded=False, now=5.0, deadline=10.0,
                               ack_deadline=2.0) == live.WAITING
    assert live.resize_outcome(broken, [0, 1], 3, exited=False, superseded=False, now=5.0,
                               deadline=10.0, ack_deadline=2.0) == TIMEOUT


def test_a_leave_whose_group_broke_meanwhile_stops_its_workers_at_once() -> None:
    pids = {0: 101, 1: 102}
    broken = {0: worker(101, LiveState.BROKEN), 1: worker(102)}
    assert live.leave_outcome(broken, pids, lambda pid: True, peers_stay=True, now=0.0,
                              deadline=5.0) == MEMBERSHIP_CHANGED


def test_a_round_that_left_out_only_the_leavers_may_still_hold_a_member_that_died() -> None:
    old = frozenset({"a", "b", "c"})
    # b announced its leave; c died a moment later: the leader's round left out b only.
    assert live.may_hold_the_dead(old, frozenset({"a", "c"}), frozenset({"b"}))
    assert live.may_hold_the_dead(old, frozenset({"a", "b", "c", "d"}), frozenset())  # a join
    # It left out c too: it was formed after c's death.
    assert not live.may_hold_the_dead(old, frozenset({"a"}), frozenset({"b"}))
