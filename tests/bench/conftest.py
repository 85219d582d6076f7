"""Benchmarks live in ``bench_*.py`` and run only when selected with ``-m bench`` (make bench)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "bench" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="benchmarks run only with -m bench (make bench)")
    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(skip)
