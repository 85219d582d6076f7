"""``tidal up``: a local cluster (embedded etcd, a coordinator, N agents) as a library.

:class:`LocalCluster` (in :mod:`service.up.cluster`) starts and supervises the
children (:mod:`service.up.children`, :mod:`service.up.supervisor`), keeps their
state (:mod:`service.up.state`), can run Prometheus beside them
(:mod:`service.up.prometheus`); :mod:`service.up.command` is the ``tidal up`` command.
"""

from __future__ import annotations

from service.up.cluster import (
    DEATH_SIGNAL,
    DEFAULT_AGENTS,
    ChildExit,
    ClusterError,
    LocalCluster,
    RestartPolicy,
    StartCancelledError,
)

__all__ = [
    "DEATH_SIGNAL",
    "DEFAULT_AGENTS",
    "ChildExit",
    "ClusterError",
    "LocalCluster",
    "RestartPolicy",
    "StartCancelledError",
]
