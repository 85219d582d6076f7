"""The agent's unit-test etcd (tests/unit/agent/fakes.py) stays a stand-in for the real client.

Each method of :class:`FakeEtcd` that the real :class:`rendezvous.etcd.EtcdClient`
also has must take the same parameters (names, kinds, defaults) and say it
returns the same type; a change to the client's facade that the fake does not
follow fails here, not as a unit test that passes against behaviour the real
client no longer has.
"""

from __future__ import annotations

import inspect

import pytest

from rendezvous.etcd import EtcdClient
from tests.unit.agent.fakes import FakeEtcd

#: FakeEtcd's helpers for tests, which the real client does not have.
TEST_HELPERS = {"put_status", "status"}


def _shared() -> list[str]:
    names = [n for n, v in vars(FakeEtcd).items() if callable(v) and not n.startswith("_")]
    return sorted(n for n in names if n not in TEST_HELPERS)


def test_every_method_of_the_fake_but_its_test_helpers_is_one_of_the_real_client() -> None:
    assert _shared(), "FakeEtcd has no client methods"
    missing = [n for n in _shared() if not hasattr(EtcdClient, n)]
    assert not missing, f"FakeEtcd has methods the real client lacks: {missing}"


@pytest.mark.parametrize("name", _shared())
def test_the_fake_takes_and_returns_what_the_real_client_does(name: str) -> None:
    real = inspect.signature(getattr(EtcdClient, name))
    fake = inspect.signature(getattr(FakeEtcd, name))

    def shape(sig: inspect.Signature) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    assert shape(fake) == shape(real), f"{name}: fake {fake} against real {real}"
    assert str(fake.return_annotation) == str(real.return_annotation), name


def test_the_fake_keeps_revisions_as_etcd_does() -> None:
    etcd = FakeEtcd()
    first = etcd.put("/k", b"1")
    second = etcd.put("/k", b"2")
    kv = etcd.get("/k")
    assert kv is not None and second > first
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"2", first, second, 2)
    assert etcd.get("/absent") is None
