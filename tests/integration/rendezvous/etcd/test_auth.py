"""`enable_auth` against a real etcd: what `tidal up` does to its own etcd.

A private etcd per test (authentication, once on, stays on). After
:func:`enable_auth`: a client without credentials can neither write nor read;
the agent user reads jobs and assignments and writes neither; the coordinator
user writes assignments; running it again (as ``tidal up`` does on every
start) acts as root and changes nothing; a wrong root password is an
:class:`EtcdAuthError`.
"""

from __future__ import annotations

import secrets

import pytest

from rendezvous.errors import EtcdAuthError
from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.auth import AGENT_USER, COORDINATOR_USER, ROOT_USER, USERS, enable_auth
from rendezvous.etcd.server import EtcdServer

ROOT = "/tidal"


def _passwords() -> dict[str, str]:
    return {user: secrets.token_hex(16) for user in USERS}


def _config(server: EtcdServer, user: str | None, passwords: dict[str, str]) -> EtcdConfig:
    return EtcdConfig(endpoints=[server.endpoint], root=ROOT, timeout_s=5, user=user,
                      password=passwords[user] if user else None)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_enable_auth_scopes_each_user_and_refuses_anonymous_clients(
    fresh_etcd: EtcdServer,
) -> None:
    passwords = _passwords()
    assert enable_auth(endpoint=fresh_etcd.endpoint, root=ROOT, passwords=passwords) is True
    with create_client(_config(fresh_etcd, None, passwords)) as anonymous:
        key = anonymous.keys.assignment("node-2", "x")
        with pytest.raises(EtcdAuthError):
            anonymous.put(key, b"{}")
        with pytest.raises(EtcdAuthError):
            anonymous.get(key)
    with create_client(_config(fresh_etcd, COORDINATOR_USER, passwords)) as coordinator:
        coordinator.put(coordinator.keys.job("x"), b"{}")
        coordinator.put(key, b"{}")
    with create_client(_config(fresh_etcd, AGENT_USER, passwords)) as agent:
        job = agent.get(agent.keys.job("x"))
        assert job is not None and job.value == b"{}"
        assert agent.get(key) is not None
        with pytest.raises(EtcdAuthError):
            agent.put(key, b"{}")
        with pytest.raises(EtcdAuthError):
            agent.put(agent.keys.job("y"), b"{}")

    # Again, as on every start of `tidal up`: as root now, nothing changes.
    assert enable_auth(endpoint=fresh_etcd.endpoint, root=ROOT, passwords=passwords) is False
    with create_client(_config(fresh_etcd, AGENT_USER, passwords)) as agent:
        assert agent.get(agent.keys.job("x")) is not None

    wrong = dict(passwords, **{ROOT_USER: "not-the-root-password"})
    with pytest.raises(EtcdAuthError, match="invalid user ID or password"):
        enable_auth(endpoint=fresh_etcd.endpoint, root=ROOT, passwords=wrong)
