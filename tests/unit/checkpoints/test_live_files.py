"""The live resize's files are a contract the runner reads without torch (rendezvous.live_files)."""

from __future__ import annotations

import checkpoints.live
import rendezvous.live_files
from tests.support.no_torch import assert_imports_without_torch


def test_the_live_files_and_the_runners_decisions_import_without_torch() -> None:
    assert_imports_without_torch("rendezvous.live_files", "agent.live")


def test_the_workers_see_the_same_contract_the_runner_does() -> None:
    for name in rendezvous.live_files.__all__:
        if name != "read_small":
            assert getattr(checkpoints.live, name) is getattr(rendezvous.live_files, name), name
