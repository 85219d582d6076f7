"""The one module that owns tidal's etcd key layout.

Every key tidal reads or writes is built here; no other module writes a key
literal. Identifiers that become part of a key (job ids, node ids) are
validated first, so a user-supplied name can never escape its prefix
(no ``/``, no ``..``, bounded length, a conservative charset).

Layout (``P`` is the root prefix, ``/tidal`` by default)::

    P/jobs/<job>                    job spec + desired state (JSON)
    P/nodes/<node>                  live node record, attached to the node's lease
    P/assignments/<node>/<job>      which jobs a node must run
    P/drains/<node>                 an operator's request that a node take no work
    P/queues/<queue>                a queue's guarantee, limit and weight (coordinator)
    P/status/<job>/<node>           what a node's agent reports for a job
    P/events/<job>/<seq>            job lifecycle events
    P/rdzv/<job>/state              torch elastic rendezvous state (etcd-v3 backend)
    P/rdzv/<job>/store/<key>        the c10d Store of that rendezvous
    P/rdzv/<job>/assigned/m/join/<node>  the agents' rendezvous (rendezvous.elastic.assigned):
    P/rdzv/<job>/assigned/m/lost/<node>  a node's join record, a dead incarnation (its ring
    P/rdzv/<job>/assigned/ctl/state      peer's word), the round's state, the mark of a
    P/rdzv/<job>/assigned/ctl/closed     finished job, the round's writer (leader: outside
    P/rdzv/<job>/assigned/leader         ctl/, watched by the leader and its deputy only), and
    P/rdzv/<job>/assigned/rank/<node>    each member's rank in the round, and the round's
    P/rdzv/<job>/assigned/roster/<chunk> members in rank order (read by a new leader)
    P/rdzv/<job>/store/<round>/<key>     the c10d store of each of its rounds
    P/election/<name>/<lease>       leader election candidates
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_ROOT = "/tidal"

# Names that end up in keys, paths and process arguments: start with an
# alphanumeric, then alphanumerics, '.', '_' or '-'; at most 63 characters
# (a DNS label's length, so node ids can be hostnames).
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_ID_RE = re.compile(ID_PATTERN)


class InvalidIdentifierError(ValueError):
    """A name that would become part of an etcd key is not acceptable."""


def validate_id(value: str, *, what: str = "identifier") -> str:
    """Return ``value`` if it is safe to embed in a key, else raise.

    Args:
        value: the candidate identifier.
        what: what the value names ("job id", "node id"), for the message.

    Returns:
        ``value`` unchanged.

    Raises:
        InvalidIdentifierError: the value is empty, too long, contains a
            character outside ``[A-Za-z0-9._-]``, starts with a punctuation
            character, or is ``.``/``..``.
    """
    if not isinstance(value, str):
        raise InvalidIdentifierError(f"{what} must be a string, not {type(value).__name__}")
    if not _ID_RE.match(value) or value in (".", ".."):
        raise InvalidIdentifierError(
            f"{what} {value!r} is not valid: use 1-63 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return value


def validate_root(root: str) -> str:
    """Check a key root such as ``/tidal`` or ``/tidal-test-3``.

    Raises:
        InvalidIdentifierError: the root does not start with ``/``, ends with
            ``/`` or has a component that is not a valid identifier.
    """
    if not root.startswith("/") or root.endswith("/"):
        raise InvalidIdentifierError(f"key root {root!r} must start with '/' and not end with '/'")
    for part in root[1:].split("/"):
        validate_id(part, what="key root component")
    return root


@dataclass(frozen=True)
class Keys:
    """Builds every key under one root prefix.

    Methods return ``str`` keys; ``*_prefix`` methods return prefixes that end
    in ``/`` so that ``job-1`` never matches ``job-10``.
    """

    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        validate_root(self.root)

    # jobs
    def jobs_prefix(self) -> str:
        return f"{self.root}/jobs/"

    def job(self, job_id: str) -> str:
        return self.jobs_prefix() + validate_id(job_id, what="job id")

    # nodes
    def nodes_prefix(self) -> str:
        return f"{self.root}/nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes_prefix() + validate_id(node_id, what="node id")

    # assignments
    def assignments_prefix(self) -> str:
        return f"{self.root}/assignments/"

    def node_assignments_prefix(self, node_id: str) -> str:
        return f"{self.assignments_prefix()}{validate_id(node_id, what='node id')}/"

    def assignment(self, node_id: str, job_id: str) -> str:
        return self.node_assignments_prefix(node_id) + validate_id(job_id, what="job id")

    def parse_assignment(self, key: str) -> tuple[str, str]:
        """``(node_id, job_id)`` of an :meth:`assignment` key.

        Raises:
            InvalidIdentifierError: ``key`` is not one :meth:`assignment` builds.
        """
        rest = key.removeprefix(self.assignments_prefix())
        node_id, sep, job_id = rest.partition("/")
        if rest == key or not sep:
            raise InvalidIdentifierError(f"{key!r} is not an assignment key")
        return validate_id(node_id, what="node id"), validate_id(job_id, what="job id")

    @staticmethod
    def id_under(prefix: str, key: str) -> str | None:
        """The identifier ``key`` names directly under ``prefix`` (one of the
        ``*_prefix`` keys above), or None for a key that is not one: outside the
        prefix, deeper than one level, or not a valid identifier. Every key is
        parsed here, never by slicing."""
        if not key.startswith(prefix):
            return None
        rest = key[len(prefix):]
        try:
            return validate_id(rest)
        except InvalidIdentifierError:
            return None

    def node_of(self, key: str) -> str | None:
        """The node id of a :meth:`node` key, else None."""
        return self.id_under(self.nodes_prefix(), key)

    def drained_node(self, key: str) -> str | None:
        """The node id of a :meth:`drain` key, else None."""
        return self.id_under(self.drains_prefix(), key)

    # drains (written by the coordinator: the node record belongs to the agent)
    def drains_prefix(self) -> str:
        return f"{self.root}/drains/"

    def drain(self, node_id: str) -> str:
        return self.drains_prefix() + validate_id(node_id, what="node id")

    # slow nodes (written by the coordinator): P/slow/<node>, a node's `slow`
    # condition after a straggler eviction (service.api.models.SlowMark)
    def slow_prefix(self) -> str:
        return f"{self.root}/slow/"

    def slow(self, node_id: str) -> str:
        return self.slow_prefix() + validate_id(node_id, what="node id")

    def slow_node(self, key: str) -> str | None:
        """The node id of a :meth:`slow` key, else None."""
        return self.id_under(self.slow_prefix(), key)

    # queues (written by the coordinator, on the admin's request)
    def queues_prefix(self) -> str:
        return f"{self.root}/queues/"

    def queue(self, name: str) -> str:
        return self.queues_prefix() + validate_id(name, what="queue name")

    # status
    def status_prefix(self) -> str:
        return f"{self.root}/status/"

    def job_status_prefix(self, job_id: str) -> str:
        return f"{self.status_prefix()}{validate_id(job_id, what='job id')}/"

    def status(self, job_id: str, node_id: str) -> str:
        return self.job_status_prefix(job_id) + validate_id(node_id, what="node id")

    # events
    def job_events_prefix(self, job_id: str) -> str:
        return f"{self.root}/events/{validate_id(job_id, what='job id')}/"

    def event(self, job_id: str, seq: int) -> str:
        if seq < 0:
            raise ValueError(f"event sequence number ({seq}) must be >= 0")
        # Zero-padded so that etcd's byte order is the numeric order.
        return f"{self.job_events_prefix(job_id)}{seq:012d}"

    # rendezvous (torch elastic, etcd-v3 backend)
    def rdzv_prefix(self, run_id: str) -> str:
        return f"{self.root}/rdzv/{validate_id(run_id, what='rendezvous run id')}/"

    def rdzv_state(self, run_id: str) -> str:
        return self.rdzv_prefix(run_id) + "state"

    def rdzv_store_prefix(self, run_id: str) -> str:
        return self.rdzv_prefix(run_id) + "store/"

    # the agents' rendezvous (rendezvous.elastic.assigned)
    def assigned_prefix(self, run_id: str) -> str:
        return self.rdzv_prefix(run_id) + "assigned/"

    def assigned_members_prefix(self, run_id: str) -> str:
        """What the round's leader watches: every join record and every lost mark."""
        return self.assigned_prefix(run_id) + "m/"

    def assigned_joins_prefix(self, run_id: str) -> str:
        return self.assigned_members_prefix(run_id) + "join/"

    def assigned_join(self, run_id: str, node_id: str) -> str:
        return self.assigned_joins_prefix(run_id) + validate_id(node_id, what="node id")

    def assigned_lost_prefix(self, run_id: str) -> str:
        return self.assigned_members_prefix(run_id) + "lost/"

    def assigned_lost(self, run_id: str, node_id: str) -> str:
        return self.assigned_lost_prefix(run_id) + validate_id(node_id, what="node id")

    def assigned_ctl_prefix(self, run_id: str) -> str:
        """What every member watches: two small keys (the state, closed)."""
        return self.assigned_prefix(run_id) + "ctl/"

    def assigned_state(self, run_id: str) -> str:
        return self.assigned_ctl_prefix(run_id) + "state"

    def assigned_leader(self, run_id: str) -> str:
        """The round leader's key: outside ``ctl/``, so that only the leader and its
        deputy watch it (a change of leader costs the other members no event)."""
        return self.assigned_prefix(run_id) + "leader"

    def assigned_closed(self, run_id: str) -> str:
        return self.assigned_ctl_prefix(run_id) + "closed"

    def assigned_ranks_prefix(self, run_id: str) -> str:
        return self.assigned_prefix(run_id) + "rank/"

    def assigned_rank(self, run_id: str, node_id: str) -> str:
        return self.assigned_ranks_prefix(run_id) + validate_id(node_id, what="node id")

    def assigned_roster_prefix(self, run_id: str) -> str:
        """The round's members in rank order, in chunks: read by a leader taking over."""
        return self.assigned_prefix(run_id) + "roster/"

    def assigned_roster(self, run_id: str, chunk: int) -> str:
        if chunk < 0:
            raise ValueError(f"roster chunk ({chunk}) must be >= 0")
        # Zero-padded so that etcd's byte order is the chunks' order.
        return f"{self.assigned_roster_prefix(run_id)}{chunk:06d}"

    def round_store_prefix(self, run_id: str, round_: int) -> str:
        if round_ < 0:
            raise ValueError(f"round ({round_}) must be >= 0")
        return f"{self.rdzv_store_prefix(run_id)}{round_}/"

    # leader election
    def election_prefix(self, name: str) -> str:
        return f"{self.root}/election/{validate_id(name, what='election name')}/"

    def election_candidate(self, name: str, lease_id: int) -> str:
        # Hex of the lease id: unique per candidate, and it names the lease
        # that fences the candidate's writes.
        return f"{self.election_prefix(name)}{lease_id:016x}"
