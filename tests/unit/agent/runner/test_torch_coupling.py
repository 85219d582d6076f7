"""The private parts of torch elastic that tidal's runner relies on, checked loudly.

:class:`agent.runner.elastic.TidalElasticAgent` extends torch's ``LocalElasticAgent``
by overriding and calling members that torch does not document as public. A
torch release that renames one, changes its parameters or stops setting one
of the attributes would break recovery in ways only the scenario tests see,
late and obscurely. This test names each one; when it fails after a torch
upgrade, it says which hook moved, and agent/runner/elastic.py (with its live path's
mixin, agent/runner/live_path.py) is the place to adapt (pyproject.toml says
``torch>=2.4``; the suite runs on the pinned release in the Makefile).

Which members each supported release has, and the one that changed shape
(``shutdown_timeout``, torch 2.12), are in agent/runner/torch_compat.py: these
tests check the running torch against it (the suite runs on the Makefile's pin;
the GPU check, tests/gpu, on the GPU machine's own torch).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousHandler

from agent.runner import torch_compat
from agent.runner.elastic import TidalElasticAgent

#: method -> its parameters (after self) the runner passes, first the positional ones:
#: those of every supported release, and ``_shutdown``'s ``timeout`` where torch has it.
METHODS: dict[str, tuple[str, ...]] = {
    **torch_compat.METHODS,
    "_shutdown": ("death_sig", "timeout") if torch_compat.SHUTDOWN_TAKES_TIMEOUT
    else ("death_sig",),
}

#: attributes the runner reads or writes on a constructed agent; ``_shutdown_timeout``
#: (a planned leave given up on shortens it) is torch's from 2.12 on, the runner's on 2.11.
ATTRIBUTES = (*torch_compat.ATTRIBUTES,
              *(("_shutdown_timeout",) if torch_compat.AGENT_TAKES_SHUTDOWN_TIMEOUT else ()))


class _NoRendezvous(RendezvousHandler):
    """Enough of a handler to construct an agent; never asked for a round."""

    def get_backend(self) -> str:
        return "none"

    def next_rendezvous(self) -> Any:
        raise AssertionError("not used")

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "coupling"

    def shutdown(self) -> bool:
        return True


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_torch_hook_the_runner_uses_is_still_there_with_its_parameters(name: str) -> None:
    member = getattr(LocalElasticAgent, name, None)
    assert member is not None, f"torch's LocalElasticAgent has no {name} any more"
    params = tuple(p for p in inspect.signature(member).parameters if p != "self")
    wanted = METHODS[name]
    positional = params[:1] == wanted[:1] or name == "_shutdown"
    assert positional and set(wanted) <= set(params), (
        f"torch's LocalElasticAgent.{name} now takes {params}, the runner passes {wanted}"
    )


def test_the_runner_overrides_what_it_means_to_and_nothing_else_private() -> None:
    # the runner's own classes: the agent and its mixins (agent.runner.live_path)
    ours = [cls for cls in TidalElasticAgent.__mro__ if cls.__module__.startswith("agent.")]
    overridden = {
        name for cls in ours for name, value in vars(cls).items()
        if name.startswith("_") and not name.startswith("__") and callable(value)
        and hasattr(SimpleElasticAgent, name)
    }
    assert overridden == {"_invoke_run", "_stop_workers", "_rendezvous"}, overridden


def test_a_constructed_agent_has_the_attributes_the_runner_reads(tmp_path: Any) -> None:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=_NoRendezvous(),
                      entrypoint="python", args=("-c", "pass"))
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    missing = [name for name in ATTRIBUTES if not hasattr(agent, name)]
    assert not missing, f"torch's LocalElasticAgent no longer sets {missing}"
    assert agent._remaining_restarts == spec.max_restarts


def test_this_torch_is_a_supported_one_and_its_shape_is_the_one_its_release_has() -> None:
    torch_compat.check_torch()  # raises, naming what is missing
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert f"{major}.{minor}" in torch_compat.SUPPORTED or (major, minor) > (2, 13), (
        f"torch {torch.__version__} is not one of {torch_compat.SUPPORTED}")
    since_2_12 = (major, minor) >= (2, 12)
    assert since_2_12 == torch_compat.AGENT_TAKES_SHUTDOWN_TIMEOUT
    assert since_2_12 == torch_compat.SHUTDOWN_TAKES_TIMEOUT


def test_the_runners_agent_keeps_a_shutdown_timeout_on_every_release(tmp_path: Any) -> None:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=_NoRendezvous(),
                      entrypoint="python", args=("-c", "pass"))
    kwargs = torch_compat.agent_kwargs(shutdown_timeout=7,
                                       logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    agent = LocalElasticAgent(spec, **kwargs)  # 2.11 refuses shutdown_timeout: not passed
    assert ("shutdown_timeout" in kwargs) == torch_compat.AGENT_TAKES_SHUTDOWN_TIMEOUT
    if torch_compat.AGENT_TAKES_SHUTDOWN_TIMEOUT:
        assert agent._shutdown_timeout == 7
