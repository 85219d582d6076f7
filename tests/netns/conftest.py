"""Fixtures for the multi-host tests: a private network of namespaces and tidal on it.

Every test here is skipped, with the reason, where network namespaces cannot
be made (not root, no ``ip``, no veth or bridge support). Each test builds its
own network and cluster and tears them down even when it fails; at the end of
the session, :func:`tests.support.netns.sweep` removes any namespace of this
process (or of a dead earlier run) that a crash left behind.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns.cluster import NetnsCluster
from tests.support.netns import Network, sweep, unavailable_reason
from tests.support.processes import ProcessGroupRegistry

HERE = Path(__file__).resolve().parent
log = logging.getLogger(__name__)


@functools.cache
def _skip_reason() -> str | None:
    return unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Benchmarks here run only when selected with ``-m bench``, as in tests/bench."""
    if "bench" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="benchmarks run only with -m bench (make bench)")
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("bench") is not None:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skip_reason.cache_info().currsize == 0 or _skip_reason() is not None:
        return  # no test here ran: nothing to sweep
    removed = sweep()
    if removed:
        log.warning("removed leftover network namespaces: %s", ", ".join(removed))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if call.when == "call":
        item.stash[_FAILED] = bool(getattr(report, "failed", False))
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def network(procs: ProcessGroupRegistry) -> Iterator[Network]:
    """A private bridge network; every namespace, link and process of it is gone afterwards."""
    sweep(include_own=False)  # leftovers of a crashed earlier run (dead owner) go first
    net = Network(procs)
    try:
        yield net
    finally:
        net.destroy()


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, network: Network, tmp_path: Path, durable_etcd_binary: Path
) -> Iterator[NetnsCluster]:
    """3 etcd hosts, a coordinator host and 3 agent hosts, all started; logs on failure."""
    built = NetnsCluster(network, tmp_path, etcd_binary=durable_etcd_binary)
    try:
        built.start()
        yield built
    finally:
        failed = request.node.stash.get(_FAILED, True)
        if failed:
            print(f"\n===== cluster logs ({tmp_path}) =====\n{built.log_tails()}")
