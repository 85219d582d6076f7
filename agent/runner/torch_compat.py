"""The torch releases the runner supports, and the private members whose shape differs.

The runner extends torch's ``LocalElasticAgent`` through members torch does not
document (tests/unit/agent/test_torch_coupling.py names each). Between the
releases tidal is tested on, one of them changed shape:

* torch 2.12 added ``shutdown_timeout`` to ``SimpleElasticAgent`` and
  ``LocalElasticAgent``'s constructors (kept as ``_shutdown_timeout``, which
  ``run()`` passes to ``_shutdown`` when a signal stops the agent) and a
  ``timeout`` parameter to ``_shutdown`` (passed on to ``PContext.close``).
  torch 2.11 has neither: its ``_shutdown(death_sig)`` closes the workers with
  ``PContext.close``'s own 30 s, and a constructor given ``shutdown_timeout``
  raises ``TypeError``. On 2.11 the runner keeps ``_shutdown_timeout`` itself
  and closes the workers' process context with its timeout before calling
  ``_shutdown`` (whose own close then finds them gone):
  :func:`agent_kwargs` and :meth:`agent.runner.elastic.TidalElasticAgent._close_workers`.
* torch 2.13 added a check for workers stuck in uninterruptible sleep to
  ``_monitor_workers`` (off unless ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``
  is set) and ``_in_exit_barrier``; the runner uses neither. 2.14's members
  are 2.13's.

Everything else the runner uses (``_invoke_run``, ``_stop_workers``,
``_rendezvous``, ``_initialize_workers``, ``_restart_workers``,
``_start_workers``, ``_monitor_workers``, ``_exit_barrier``, ``_worker_group``,
``_remaining_restarts``, ``_pcontext``, ``PContext.close(death_sig, timeout)``)
is the same in 2.11, 2.12 and 2.13. The differences are detected from the
signatures, not the version number; :func:`check_torch` refuses a torch that
lacks a member the runner needs, naming the supported releases.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext

#: The releases whose torch elastic sources were compared member by member (pyproject.toml
#: says the same): the suite runs on 2.13; 2.11's elastic package ran the runner's tests on
#: 2.13's core; 2.12's members are 2.13's, 2.14's too.
SUPPORTED = ("2.11", "2.12", "2.13")

#: method -> the parameters (after self) the runner passes on every tested release.
METHODS: dict[str, tuple[str, ...]] = {
    "_invoke_run": ("role",),  # overridden: the runner's own monitor loop
    "_stop_workers": ("worker_group",),  # overridden: a grace period per cause
    "_initialize_workers": ("worker_group",),
    "_restart_workers": ("worker_group",),
    "_rendezvous": ("worker_group",),  # overridden: times the rendezvous for goodput
    "_start_workers": ("worker_group",),
    "_monitor_workers": ("worker_group",),
    "_shutdown": ("death_sig",),  # by keyword; ``timeout`` too since 2.12
    "_exit_barrier": (),
}

#: attributes a constructed LocalElasticAgent has on every tested release.
ATTRIBUTES = ("_worker_group", "_remaining_restarts", "_pcontext")


def _parameters(member: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(member).parameters if p != "self")


#: torch >= 2.12: the constructors take ``shutdown_timeout`` and keep ``_shutdown_timeout``.
AGENT_TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in _parameters(LocalElasticAgent.__init__)
#: torch >= 2.12: ``_shutdown(death_sig, timeout)``; 2.11: ``_shutdown(death_sig)``.
SHUTDOWN_TAKES_TIMEOUT = "timeout" in _parameters(LocalElasticAgent._shutdown)


class UnsupportedTorchError(RuntimeError):
    """This torch lacks a private member of torch elastic the runner needs."""


def missing_members() -> list[str]:
    """What the runner needs of torch elastic and this torch does not have."""
    missing = []
    for name, wanted in METHODS.items():
        member = getattr(LocalElasticAgent, name, None)
        if member is None:
            missing.append(f"LocalElasticAgent.{name}")
            continue
        params = _parameters(member)
        if not set(wanted) <= set(params) or (name != "_shutdown" and params[:1] != wanted[:1]):
            missing.append(f"LocalElasticAgent.{name}({', '.join(wanted)}), "
                           f"not ({', '.join(params)})")
    if "timeout" not in _parameters(PContext.close):
        missing.append("PContext.close(death_sig, timeout)")
    return missing


def check_torch() -> None:
    """Refuse to run on a torch whose elastic agent lacks what the runner overrides or calls.

    Raises:
        UnsupportedTorchError: naming what is missing and the supported releases.
    """
    missing = missing_members()
    if missing:
        raise UnsupportedTorchError(
            f"tidal's runner does not support torch {torch.__version__}: its elastic agent "
            f"lacks {'; '.join(missing)}. Supported: torch {', '.join(SUPPORTED)}"
        )


def agent_kwargs(*, shutdown_timeout: int, **kwargs: Any) -> dict[str, Any]:
    """LocalElasticAgent's keyword arguments on this torch (``shutdown_timeout`` from 2.12 on)."""
    if AGENT_TAKES_SHUTDOWN_TIMEOUT:
        kwargs["shutdown_timeout"] = shutdown_timeout
    return kwargs
