"""tidal's Python client: drive a cluster from code, as the ``tidal`` command does.

::

    from service.client import Client

    with Client() as tidal:  # TIDAL_URL / TIDAL_TOKEN, else the cluster `tidal up` started
        job = tidal.submit(name="train", command=["python", "train.py"], max_nodes=4)
        for line in tidal.logs(job.job_id, follow=True):
            print(line)
        done = tidal.wait(job.job_id, check=True)  # raises JobFailedError if it failed

:class:`Client` has one method per thing a user does (submit, get, list,
wait, logs, events, scale, cancel, drain, undrain, nodes, and the queues:
queues, create_queue, update_queue, delete_queue) and answers with the API's own
pydantic models (:class:`~service.api.models.JobView`, :class:`~service.api.models.EventList`,
:class:`~service.api.models.NodeView`, :class:`~service.api.queues.QueueList`).
:class:`AsyncClient` is its twin for asyncio: the same methods, awaited (its
``logs`` is an async iterator).

Every failure is one of :mod:`service.client.errors`, never a transport exception:
:class:`RefusedError` (and its subclasses :class:`NotFoundError`,
:class:`ConflictError`, ...) when the coordinator said no,
:class:`UnavailableError` when it could not be reached or failed,
:class:`NotConfiguredError` when no coordinator is configured. Each carries
the exit code the ``tidal`` command line exits with for it.

Both clients share what a call is (:class:`service.client.calls.Call`: method,
path, body, the model of its answer) and how an answer or a transport failure becomes a result
or an error (:class:`service.client.base.ClientBase`); they differ only in how they send.
The package's modules: :mod:`service.client.sync` (:class:`Client`),
:mod:`service.client.aio` (:class:`AsyncClient`), :mod:`service.client.errors`,
:mod:`service.client.calls`, :mod:`service.client.base` and :mod:`service.client.target`
(where the coordinator is). This package never imports torch or the agent.
"""

from __future__ import annotations

from service.client.aio import AsyncClient
from service.client.calls import (
    build_spec,
    default_name,
)
from service.client.errors import (
    EXIT_INTERRUPTED,
    EXIT_JOB_CANCELLED,
    EXIT_JOB_FAILED,
    EXIT_NOT_CONFIGURED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    PHASE_EXIT,
    ApiError,
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    InvalidSpecError,
    JobCancelledError,
    JobEndedError,
    JobFailedError,
    NotConfiguredError,
    NotFoundError,
    RefusedError,
    TidalError,
    UnauthorizedError,
    UnavailableError,
    WaitTimeoutError,
    check_outcome,
    exit_code,
)
from service.client.sync import (
    Client,
    TidalClient,
)
from service.client.target import (
    CLUSTER_FILE,
    AgentEntry,
    ClusterFile,
    Target,
    TargetError,
    default_state_dir,
    load_cluster,
    resolve_target,
)

__all__ = [
    "CLUSTER_FILE",
    "EXIT_INTERRUPTED",
    "EXIT_JOB_CANCELLED",
    "EXIT_JOB_FAILED",
    "EXIT_NOT_CONFIGURED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "PHASE_EXIT",
    "AgentEntry",
    "ApiError",
    "AsyncClient",
    "Client",
    "ClusterFile",
    "ConflictError",
    "ForbiddenError",
    "InvalidRequestError",
    "InvalidSpecError",
    "JobCancelledError",
    "JobEndedError",
    "JobFailedError",
    "NotConfiguredError",
    "NotFoundError",
    "RefusedError",
    "Target",
    "TargetError",
    "TidalClient",
    "TidalError",
    "UnauthorizedError",
    "UnavailableError",
    "WaitTimeoutError",
    "build_spec",
    "check_outcome",
    "default_name",
    "default_state_dir",
    "exit_code",
    "load_cluster",
    "resolve_target",
]
