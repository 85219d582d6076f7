"""The errors of tidal's Python client and command line, each with its exit code.

One hierarchy for both: the client (:mod:`service.client.sync`) raises these, and
the ``tidal`` command line prints ``error: <message>`` and exits with the
error's :attr:`TidalError.exit_code`; there is no second table. The exit codes
scripts can rely on:

* 0 (:data:`EXIT_OK`): done; for a followed job, it SUCCEEDED;
* 1 (:data:`EXIT_JOB_FAILED`): the job FAILED (:class:`JobFailedError`);
* 2 (:data:`EXIT_USAGE`): wrong usage, an invalid job spec (:class:`InvalidSpecError`);
* 3 (:data:`EXIT_JOB_CANCELLED`): the job was CANCELLED (:class:`JobCancelledError`);
* 4 (:data:`EXIT_REFUSED`): the coordinator refused the request
  (:class:`RefusedError`: 401, 403, 404, 409, 413, 422);
* 5 (:data:`EXIT_UNREACHABLE`): the coordinator could not be reached, did not
  answer in time, answered something this client cannot read, or failed (5xx)
  (:class:`UnavailableError`);
* 6 (:data:`EXIT_NOT_CONFIGURED`): no coordinator is configured, or the token
  or cluster file cannot be read (:class:`NotConfiguredError`);
* 7 (:data:`EXIT_TIMEOUT`): a wait's timeout passed before the job ended
  (:class:`WaitTimeoutError`; the job goes on);
* 130 (:data:`EXIT_INTERRUPTED`): interrupted with Ctrl-C (not an error class).

Messages are sentences that name the value; a job's environment values are
never part of one.
"""

from __future__ import annotations

from typing import Any, ClassVar

from service.api.models import JobPhase, JobView

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_JOB_CANCELLED = 3
EXIT_REFUSED = 4
EXIT_UNREACHABLE = 5
EXIT_NOT_CONFIGURED = 6
EXIT_TIMEOUT = 7
EXIT_INTERRUPTED = 130

PHASE_EXIT: dict[JobPhase, int] = {
    JobPhase.SUCCEEDED: EXIT_OK,
    JobPhase.FAILED: EXIT_JOB_FAILED,
    JobPhase.CANCELLED: EXIT_JOB_CANCELLED,
}


def exit_code(view: JobView) -> int | None:
    """The exit code of a job's outcome (0, 1 or 3); None while it has not ended."""
    return PHASE_EXIT.get(view.phase)


class TidalError(Exception):
    """Anything the tidal client or command line reports as a failure.

    Attributes:
        message: one sentence saying what failed.
        exit_code: the command line's exit status for it.
    """

    exit_code: ClassVar[int] = 1  # each subclass names its own

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidSpecError(TidalError):
    """A job spec that does not validate here, before anything was sent (exit 2)."""

    exit_code = EXIT_USAGE


class NotConfiguredError(TidalError):
    """No coordinator is configured, or its configuration cannot be read (exit 6)."""

    exit_code = EXIT_NOT_CONFIGURED


class ApiError(TidalError):
    """A call to the coordinator that did not succeed.

    Attributes:
        status: the HTTP status, or 0 when no (usable) answer came: connection
            refused, a timeout, a malformed answer.
        detail: the server's ``detail`` list (field errors of a 422), if any.
    """

    def __init__(
        self, message: str, *, status: int, detail: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail or []

    @property
    def unreachable(self) -> bool:
        """True when the coordinator gave no (usable) answer at all."""
        return self.status == 0

    @property
    def transient(self) -> bool:
        """True when trying again later may succeed (no answer, or a 5xx)."""
        return self.status == 0 or self.status >= 500


class RefusedError(ApiError):
    """The coordinator answered and refused the request (a 4xx; exit 4)."""

    exit_code = EXIT_REFUSED


class UnauthorizedError(RefusedError):
    """401: no token, or the wrong one."""


class ForbiddenError(RefusedError):
    """403: the token may not do this (a token scoped to another queue)."""


class NotFoundError(RefusedError):
    """404: no such job or node."""


class ConflictError(RefusedError):
    """409: not allowed in the job's phase (scaling a finished job, cancelling twice)."""


class InvalidRequestError(RefusedError):
    """413 or 422: values the coordinator does not accept; :attr:`detail` names the fields."""


class UnavailableError(ApiError):
    """No usable answer (status 0) or a server failure (5xx, e.g. 503 while etcd
    is down); trying again later may work (exit 5)."""

    exit_code = EXIT_UNREACHABLE


_BY_STATUS: dict[int, type[RefusedError]] = {
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
}


def api_error(
    status: int, message: str, *, detail: list[dict[str, Any]] | None = None
) -> ApiError:
    """The error class for an HTTP ``status`` (0 for no answer): the one place
    that decides which status is refused (exit 4) and which unavailable (exit 5)."""
    if status == 0 or status >= 500 or status < 400:
        return UnavailableError(message, status=status, detail=detail)
    return _BY_STATUS.get(status, RefusedError)(message, status=status, detail=detail)


class WaitTimeoutError(TidalError):
    """A wait for a job's end gave up; the job goes on (exit 7).

    Attributes:
        job_id: the job waited for.
        last: its last view seen, if any.
    """

    exit_code = EXIT_TIMEOUT

    def __init__(self, message: str, *, job_id: str, last: JobView | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.last = last


class JobEndedError(TidalError):
    """A waited-for job ended without succeeding (raised only when asked: ``check=True``).

    Attributes:
        view: the job's final view (its ``error`` says why a failed job failed).
    """

    def __init__(self, message: str, *, view: JobView) -> None:
        super().__init__(message)
        self.view = view

    @property
    def job_id(self) -> str:
        return self.view.job_id


class JobFailedError(JobEndedError):
    """The job FAILED (exit 1)."""

    exit_code = EXIT_JOB_FAILED


class JobCancelledError(JobEndedError):
    """The job was CANCELLED (exit 3)."""

    exit_code = EXIT_JOB_CANCELLED


def check_outcome(view: JobView) -> JobView:
    """``view`` if its job SUCCEEDED (or has not ended).

    Raises:
        JobFailedError: it FAILED; the message names the failing rank's error.
        JobCancelledError: it was CANCELLED.
    """
    if view.phase == JobPhase.FAILED:
        why = ""
        if view.error is not None and view.error.message:
            why = f": {view.error.message}"
        elif view.exit_reason is not None:
            why = f" ({view.exit_reason.value})"
        raise JobFailedError(f"job {view.job_id} FAILED{why}", view=view)
    if view.phase == JobPhase.CANCELLED:
        raise JobCancelledError(f"job {view.job_id} was CANCELLED", view=view)
    return view
