"""The zygote's own check of the modules it is told to preload (agent.workers.zygote);
the zygote itself, with real processes, is in tests/integration/agent/workers/test_zygote.py."""

from __future__ import annotations

import pytest

from agent.workers.zygote import MAX_MODULE_NAME_LEN, MODULE_NAME, preload_names
from rendezvous.records import MAX_MODULE_NAME_LEN as SUBMIT_MAX_LEN
from rendezvous.records import MODULE_NAME_PATTERN


def test_the_zygote_checks_names_as_the_coordinator_does() -> None:
    assert MODULE_NAME.pattern == MODULE_NAME_PATTERN
    assert MAX_MODULE_NAME_LEN == SUBMIT_MAX_LEN


def test_module_names_are_taken_in_order_once_each() -> None:
    assert preload_names("") == ([], [])
    assert preload_names("transformers") == (["transformers"], [])
    assert preload_names(" transformers , lightning.pytorch,,_x,transformers") == (
        ["transformers", "lightning.pytorch", "_x"], []
    )


@pytest.mark.parametrize(
    "bad",
    ["my-lib", "os; import shutil", "../evil", "/abs/path", ".relative", "a..b", "trailing.",
     "1st", "caf\u00e9", "a b", "torch\0", "x" * (MAX_MODULE_NAME_LEN + 1)],
)
def test_what_is_not_a_module_name_is_refused_and_the_rest_kept(bad: str) -> None:
    assert preload_names(f"numpy,{bad},scipy") == (["numpy", "scipy"], [bad])
