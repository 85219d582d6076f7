"""Schema-driven fuzzing of the coordinator's API: no input may produce a 5xx.

schemathesis generates requests from the OpenAPI document the real server
serves (valid and invalid bodies, path and query values) and sends them with
the token; every answer must be a non-5xx status. Each operation gets its own
hypothesis run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rendezvous.etcd.server import EtcdServer
from tests.support.coordinator import TOKEN, CoordinatorProcess
from tests.support.processes import ProcessGroupRegistry

EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def fuzz_coordinator(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: EtcdServer
) -> Iterator[CoordinatorProcess]:
    procs = ProcessGroupRegistry()
    try:
        yield CoordinatorProcess(
            etcd_endpoint=etcd_server.endpoint, etcd_root="/tidal-fuzz",
            workdir=tmp_path_factory.mktemp("fuzz"), procs=procs,
        ).start()
    finally:
        procs.stop_all()


@pytest.mark.slow
def test_no_generated_request_makes_the_server_fail(
    fuzz_coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    url = fuzz_coordinator.url
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        cases = st.one_of(
            operation.as_strategy(mode) for mode in schemathesis.GenerationMode
        )

        @given(case=cases, data=st.data())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def probe(case: schemathesis.Case, data: st.DataObject) -> None:
            headers = {**(case.headers or {}), "Authorization": f"Bearer {TOKEN}"}
            response = case.call(base_url=url, headers=headers, timeout=30)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} {case.body!r:.200} -> "
                                f"{response.status_code} {response.text[:300]}")

        probe()
    assert operations >= 9
    # Both valid and invalid input reached the server.
    assert statuses[422] > 0 and sum(statuses[c] for c in (200, 201, 202)) > 0, statuses
    assert failures == [], "\n".join(failures[:20])
