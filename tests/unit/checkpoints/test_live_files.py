"""The live resize's files are a contract the runner reads without torch
(checkpoints.protocol.live)."""

from __future__ import annotations

import checkpoints.live
import checkpoints.protocol.live
from tests.support.no_torch import assert_imports_without_torch


def test_the_live_files_and_the_runners_decisions_import_without_torch() -> None:
    assert_imports_without_torch("checkpoints.protocol.live", "agent.runner.live_decide")


def test_the_workers_see_the_same_contract_the_runner_does() -> None:
    for name in checkpoints.protocol.live.__all__:
        if name != "read_small":
            assert getattr(checkpoints.live, name) is getattr(checkpoints.protocol.live, name), name
