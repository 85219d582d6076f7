"""The chaos soak's decisions, kept apart from the processes.

:func:`fault_plan` says which fault comes next (a pure function of a seeded
``random.Random``): first every enabled kind once, in a shuffled order, so that
even a short soak hits each kind; then kinds drawn at random.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from enum import Enum


class FaultKind(str, Enum):
    """What the soak does to one process. Which of them the job's events show:
    see :data:`EVENT_OF`."""

    KILL_AGENT = "kill_agent"  # SIGKILL an agent's process group; restarted after node_lost
    KILL_RUNNER = "kill_runner"  # SIGKILL one node's job runner
    KILL_WORKER = "kill_worker"  # SIGKILL one training worker
    KILL_COORDINATOR = "kill_coordinator"  # SIGKILL one of the two coordinators; restarted
    KILL_ETCD = "kill_etcd"  # SIGKILL one etcd member; restarted on its data directory
    STOP = "stop"  # SIGSTOP an agent's group, a coordinator or an etcd member, then SIGCONT


#: The job events a fault must produce, by kind (for STOP: when an agent was
#: stopped past its lease). A killed worker or runner is a restart charged to its
#: node's budget: a ``restart_charged`` event naming the node (unless the node
#: left the job instead, which node_lost/node_joined events tell). The others
#: leave no job event by design: a coordinator's or an etcd member's death must
#: leave the job alone, so for those the soak checks that *no* node_lost event
#: appeared (no node falsely declared lost).
EVENT_OF: dict[FaultKind, tuple[str, ...]] = {
    FaultKind.KILL_AGENT: ("node_lost", "node_joined"),
    FaultKind.STOP: ("node_lost", "node_joined"),
    FaultKind.KILL_RUNNER: ("restart_charged",),
    FaultKind.KILL_WORKER: ("restart_charged",),
}


def fault_plan(rng: random.Random, kinds: Sequence[FaultKind]) -> Iterator[FaultKind]:
    """Faults to inject, for ever: each of ``kinds`` once in a shuffled order, then at random.

    Raises:
        ValueError: ``kinds`` is empty.
    """
    if not kinds:
        raise ValueError("the chaos soak needs at least one kind of fault")
    ordered = sorted(set(kinds), key=lambda k: k.value)
    yield from rng.sample(ordered, len(ordered))
    while True:
        yield rng.choice(ordered)
