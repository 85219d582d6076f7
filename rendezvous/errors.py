"""The errors of everything that talks to etcd.

A failed etcd call raises a ``grpc.RpcError`` with a status code and details.
It is translated once, at the boundary (:mod:`rendezvous.etcd.translate`), into
this small hierarchy, so callers catch ``EtcdError`` and its subclasses and
never import pyetcd or grpc.
"""

from __future__ import annotations


class EtcdError(Exception):
    """Base class of every etcd-related error tidal raises."""


class EtcdUnavailableError(EtcdError):
    """etcd could not be reached, or did not answer within the timeout."""


class EtcdAuthError(EtcdError):
    """etcd refused the credentials (user/password, client certificate)."""


class EtcdNoSpaceError(EtcdError):
    """etcd is out of space (its backend quota is exhausted)."""


class EtcdCompactedError(EtcdError):
    """A watch asked for a revision that etcd has already compacted away.

    Attributes:
        compact_revision: the oldest revision etcd still holds.
    """

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class LeaseExpiredError(EtcdError):
    """A lease this process held has expired or was revoked."""


class EtcdBinaryNotFoundError(EtcdError):
    """No etcd executable could be found to start an embedded server."""
