"""What the agents report about a job, folded into its record: pure functions the
scheduler (and the API's views) use.

* the reports *in force*: of the node's assignment at its current generation
  (:func:`statuses_in_force`);
* the restarts an agent charged to a node's budget, counted into the job's
  ``restarts`` once each (:func:`restart_charges`);
* which way each membership change went on each node, live or by a restart,
  each rise turned into one event (:func:`resize_rises`, :func:`resized_live`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.records import Assignment, JobNodeState, JobNodeStatus
from service.api.models import ChargedRestarts, SeenResizes


def statuses_in_force(
    generations: Mapping[str, int], statuses: dict[str, JobNodeStatus]
) -> dict[str, JobNodeStatus]:
    """The reports of the assignments in force: same node, same generation.

    Args:
        generations: node -> generation of the job's assignment there.
        statuses: node -> what that node's agent reported for the job.
    """
    return {
        node: st for node, st in statuses.items() if generations.get(node) == st.generation
    }


def current_statuses(
    assigned: dict[str, Assignment], statuses: dict[str, JobNodeStatus]
) -> dict[str, JobNodeStatus]:
    """:func:`statuses_in_force` for a node -> :class:`Assignment` map."""
    return statuses_in_force({n: a.generation for n, a in assigned.items()}, statuses)


#: The restart reason whose restarts the agents charge to a node's budget.
CHARGED_REASON = "worker_failed"


@dataclass(frozen=True)
class Charge:
    """A rise of one node's charged restart count that the job's record has not counted."""

    node_id: str
    before: int  # what the record had counted of this node's generation
    status: JobNodeStatus  # the report now: ``restart_reasons[CHARGED_REASON]`` above ``before``

    @property
    def count(self) -> int:
        return self.status.restart_reasons.get(CHARGED_REASON, 0)

    @property
    def restarts(self) -> int:
        """The restarts of the rise that restarted the node's workers (the last
        charge of a node whose budget is spent ended it instead)."""
        rise = self.count - self.before
        return rise - 1 if self.status.state == JobNodeState.FAILED else rise


def restart_charges(
    charged: Mapping[str, ChargedRestarts],
    generations: Mapping[str, int],
    statuses: Mapping[str, JobNodeStatus],
) -> tuple[dict[str, ChargedRestarts], list[Charge]]:
    """Fold the charged restarts the nodes report into what a job's record counted.

    An agent counts a node's charged restarts per assignment generation: a node
    that leaves and rejoins starts again from 0. The record keeps, per node, the
    generation and the count it has already added to the job's ``restarts``; a
    report of that generation adds only its rise, one of a new generation all of
    its count. Entries of nodes no longer assigned at that generation are dropped.

    Args:
        charged: the record's ``charged``.
        generations: node -> generation of the job's assignment there (in force).
        statuses: node -> what that node's agent reported for the job.

    Returns:
        The new ``charged``, and the rises not yet counted (sorted by node).
    """
    folded = {
        node: seen for node, seen in charged.items() if generations.get(node) == seen.generation
    }
    rises: list[Charge] = []
    for node, st in sorted(statuses_in_force(generations, dict(statuses)).items()):
        count = st.restart_reasons.get(CHARGED_REASON, 0)
        seen = folded.get(node)
        before = seen.worker_failed if seen is not None else 0
        if count > before:
            rises.append(Charge(node, before, st))
            folded[node] = ChargedRestarts(generation=st.generation, worker_failed=count)
    return folded, rises


def resize_rises(
    seen: Mapping[str, SeenResizes],
    generations: Mapping[str, int],
    statuses: Mapping[str, JobNodeStatus],
) -> tuple[dict[str, SeenResizes], dict[str, list[JobNodeStatus]]]:
    """Fold the resize paths the nodes report (agent.runner.live_decide) into what the record
    gave events.

    Args:
        seen: the record's ``resized``.
        generations: node -> generation of the job's assignment there (in force).
        statuses: node -> what that node's agent reported for the job.

    Returns:
        The new ``resized``, and by path ("live", "restart") the reports of the
        nodes whose count of it rose (sorted by node). Entries of nodes no
        longer assigned at that generation are dropped.
    """
    folded = {node: s for node, s in seen.items() if generations.get(node) == s.generation}
    rises: dict[str, list[JobNodeStatus]] = {}
    for node, st in sorted(statuses_in_force(generations, dict(statuses)).items()):
        before = folded[node].paths if node in folded else {}
        risen = [p for p, count in st.resize_paths.items() if count > before.get(p, 0)]
        if risen:
            folded[node] = SeenResizes(generation=st.generation, paths=dict(st.resize_paths))
            for path in risen:
                rises.setdefault(path, []).append(st)
    return folded, rises


def resized_live(reports: Mapping[str, JobNodeStatus]) -> bool:
    """Whether the job's last membership change went the live path on its nodes.

    True when every node that says how its last change went (``last_resize``)
    says "live", and at least one does; a node that joined, or whose runner
    started anew, says nothing.
    """
    said = [st.last_resize for st in reports.values() if st.last_resize]
    return bool(said) and all(s == "live" for s in said)


__all__ = ["CHARGED_REASON", "Charge", "current_statuses", "resize_rises", "resized_live",
           "restart_charges", "statuses_in_force"]
