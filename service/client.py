"""A small typed client of the coordinator's HTTP API, and where to find a cluster.

:class:`TidalClient` wraps one ``httpx.Client``: one method per endpoint,
answers parsed into the models of :mod:`service.models`. Every failure is one
:class:`ApiError`: the server's own ``error`` text for a non-2xx answer, or a
sentence saying the coordinator could not be reached (``status`` 0), never a
transport exception.

:func:`resolve_target` decides which coordinator a command talks to and with
which token: flags, then ``TIDAL_URL`` / ``TIDAL_TOKEN`` / ``TIDAL_TOKEN_FILE``,
then the ``cluster.json`` that ``tidal up`` writes into its state directory.

This module is imported by the command line only; it never imports torch or
the agent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from service.models import EventList, JobList, JobPhase, JobSpec, JobView, NodeView

CLUSTER_FILE = "cluster.json"
DEFAULT_TIMEOUT_S = 10.0
# A coordinator that does not accept a connection within this is down or
# unreachable; there is no point waiting the full request timeout for it.
MAX_CONNECT_TIMEOUT_S = 5.0
M = TypeVar("M", bound=BaseModel)
_NODE_LIST: TypeAdapter[list[NodeView]] = TypeAdapter(list[NodeView])


class ApiError(Exception):
    """A call to the coordinator that did not succeed.

    Attributes:
        status: the HTTP status, or 0 when no answer came (connection refused,
            timeout, a malformed answer).
        message: the server's ``error`` text, or a sentence saying what failed.
        detail: the server's ``detail`` list (field errors of a 422), if any.
    """

    def __init__(
        self, status: int, message: str, *, detail: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail or []

    @property
    def unreachable(self) -> bool:
        """True when the coordinator gave no (usable) answer at all."""
        return self.status == 0

    @property
    def transient(self) -> bool:
        """True when trying again later may succeed (no answer, or a 5xx)."""
        return self.status == 0 or self.status >= 500


class TargetError(Exception):
    """No coordinator is configured, or its configuration cannot be read."""


class AgentEntry(BaseModel):
    """One agent of a local cluster, as ``tidal up`` records it."""

    model_config = ConfigDict(extra="ignore")

    node_id: str
    pid: int | None = None
    run_dir: Path
    metrics_port: int | None = None


class ClusterFile(BaseModel):
    """``STATE_DIR/cluster.json``, written by ``tidal up``; only read here."""

    model_config = ConfigDict(extra="ignore")

    url: str
    token_file: Path | None = None
    etcd_endpoint: str | None = None
    etcd_root: str | None = None
    state_dir: Path | None = None
    coordinator_pid: int | None = None
    etcd_pid: int | None = None
    agents: list[AgentEntry] = Field(default_factory=list)


@dataclass(frozen=True)
class Target:
    """A coordinator to talk to.

    Attributes:
        url: its base URL, without a trailing slash.
        token: the bearer token; None sends none (a server run with
            ``--insecure-no-auth``).
        url_source: where the URL came from ("--url", "TIDAL_URL" or the
            cluster file's path), for messages.
        cluster: the state directory's cluster file, when there is one.
        cluster_path: where that file is (or would be).
    """

    url: str
    token: str | None
    url_source: str
    cluster: ClusterFile | None
    cluster_path: Path


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$TIDAL_HOME``, else ``~/.tidal``: where ``tidal up`` keeps a local cluster."""
    env = os.environ if environ is None else environ
    home = env.get("TIDAL_HOME")
    return Path(home).expanduser() if home else Path.home() / ".tidal"


def load_cluster(state_dir: Path) -> ClusterFile | None:
    """The cluster file in ``state_dir``; None when there is none.

    Raises:
        TargetError: the file exists but cannot be read or is not a cluster file.
    """
    path = state_dir / CLUSTER_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TargetError(f"cannot read the cluster file {path}: {exc}") from exc
    try:
        return ClusterFile.model_validate_json(text)
    except ValidationError as exc:
        fields = ", ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}"
            for err in exc.errors()[:3]
        )
        raise TargetError(f"the cluster file {path} is not valid ({fields})") from exc


def _read_token_file(path: Path, *, source: str) -> str:
    try:
        token = path.expanduser().read_text().strip()
    except OSError as exc:
        raise TargetError(f"cannot read the token file {path} (from {source}): {exc}") from exc
    if not token:
        raise TargetError(f"the token file {path} (from {source}) is empty")
    return token


def _check_url(url: str, *, source: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise TargetError(f"the coordinator URL {url!r} (from {source}) must start with "
                          "http:// or https://")
    return url


def resolve_target(
    url_flag: str | None,
    token_flag: str | None,
    state_dir: Path | None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Target:
    """Which coordinator to talk to, and with which token.

    The URL comes from ``url_flag``, else ``TIDAL_URL``, else the cluster file
    in ``state_dir`` (default :func:`default_state_dir`). The token comes from
    ``token_flag``, else ``TIDAL_TOKEN``, else the file named by
    ``TIDAL_TOKEN_FILE``, else the cluster file's ``token_file``; the cluster
    file's token is used only for the cluster file's own URL, so a local
    cluster's token is never sent to another server.

    Args:
        url_flag: ``--url``, if given.
        token_flag: ``--token``, if given.
        state_dir: ``--state-dir``, if given.
        environ: the environment to read (default ``os.environ``).

    Returns:
        The target; its token is None when none was found (a server without
        authentication accepts that, any other answers 401).

    Raises:
        TargetError: no URL anywhere, an unreadable token or cluster file, or a
            URL that is not http(s).
    """
    env = os.environ if environ is None else environ
    state = state_dir if state_dir is not None else default_state_dir(env)
    cluster_path = state / CLUSTER_FILE
    try:
        cluster = load_cluster(state)
    except TargetError:
        if not (url_flag or env.get("TIDAL_URL")):
            raise
        cluster = None  # not needed: a broken local cluster file must not block --url
    if url_flag:
        url, url_source = _check_url(url_flag, source="--url"), "--url"
    elif env.get("TIDAL_URL"):
        url, url_source = _check_url(env["TIDAL_URL"], source="TIDAL_URL"), "TIDAL_URL"
    elif cluster is not None:
        url, url_source = _check_url(cluster.url, source=str(cluster_path)), str(cluster_path)
    else:
        raise TargetError(
            f"no tidal coordinator configured: pass --url (or set TIDAL_URL), or start a "
            f"local cluster with `tidal up` (no cluster file at {cluster_path})"
        )
    token: str | None
    if token_flag:
        token = token_flag.strip()
    elif env.get("TIDAL_TOKEN"):
        token = env["TIDAL_TOKEN"].strip()
    elif env.get("TIDAL_TOKEN_FILE"):
        token = _read_token_file(Path(env["TIDAL_TOKEN_FILE"]), source="TIDAL_TOKEN_FILE")
    elif (
        cluster is not None
        and cluster.token_file is not None
        and _check_url(cluster.url, source=str(cluster_path)) == url
    ):
        token = _read_token_file(cluster.token_file, source=str(cluster_path))
    else:
        token = None
    return Target(url=url, token=token, url_source=url_source, cluster=cluster,
                  cluster_path=cluster_path)


def _job_path(job_id: str, suffix: str = "") -> str:
    # Quoted whole, so an id like "../nodes" stays one path segment (and gets a 404/422).
    return f"/v1/jobs/{quote(job_id, safe='')}{suffix}"


def _node_path(node_id: str) -> str:
    return f"/v1/nodes/{quote(node_id, safe='')}/drain"


class TidalClient:
    """The coordinator's API over HTTP.

    Args:
        url: the coordinator's base URL (``http://HOST:PORT``).
        token: the bearer token; None sends no ``Authorization`` header.
        timeout: seconds for each request (connecting takes at most 5 s of it).
        transport: an httpx transport to use instead of the network (tests).

    Every method raises :class:`ApiError` when the call did not succeed.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        headers = {"Accept": "application/json", "User-Agent": "tidal-cli"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, MAX_CONNECT_TIMEOUT_S)),
            transport=transport,
            follow_redirects=False,
        )

    def __enter__(self) -> TidalClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # jobs ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> JobView:
        """``POST /v1/jobs``: the new job, PENDING."""
        body = spec.model_dump(mode="json", exclude_unset=True)
        return self._parse(JobView, self._call("POST", "/v1/jobs", json=body))

    def list_jobs(
        self, *, phase: JobPhase | None = None, limit: int | None = None,
        cursor: str | None = None,
    ) -> JobList:
        """``GET /v1/jobs``: one page of jobs, oldest first."""
        params: dict[str, str | int] = {}
        if phase is not None:
            params["phase"] = phase.value
        if limit is not None:
            params["limit"] = limit
        if cursor is not None:
            params["cursor"] = cursor
        return self._parse(JobList, self._call("GET", "/v1/jobs", params=params))

    def iter_jobs(self, *, phase: JobPhase | None = None, page_size: int = 500
                  ) -> Iterator[JobView]:
        """Every job, page after page, oldest first."""
        cursor: str | None = None
        seen: set[str] = set()
        while True:
            page = self.list_jobs(phase=phase, limit=page_size, cursor=cursor)
            yield from page.jobs
            if page.next_cursor is None or page.next_cursor in seen:
                return
            seen.add(page.next_cursor)
            cursor = page.next_cursor

    def get_job(self, job_id: str) -> JobView:
        """``GET /v1/jobs/{id}``."""
        return self._parse(JobView, self._call("GET", _job_path(job_id)))

    def scale(
        self, job_id: str, *, min_nodes: int | None = None, max_nodes: int | None = None
    ) -> JobView:
        """``PATCH /v1/jobs/{id}``: new bounds; the server checks them against each other."""
        body = {k: v for k, v in (("min_nodes", min_nodes), ("max_nodes", max_nodes))
                if v is not None}
        return self._parse(JobView, self._call("PATCH", _job_path(job_id), json=body))

    def cancel(self, job_id: str) -> JobView:
        """``POST /v1/jobs/{id}/cancel``: the job with ``cancel_requested`` set."""
        return self._parse(JobView, self._call("POST", _job_path(job_id, "/cancel")))

    def events(self, job_id: str) -> EventList:
        """``GET /v1/jobs/{id}/events``: the job's history, by sequence number."""
        return self._parse(EventList, self._call("GET", _job_path(job_id, "/events")))

    # nodes -----------------------------------------------------------------------------

    def nodes(self) -> list[NodeView]:
        """``GET /v1/nodes``: the live nodes."""
        data = self._call("GET", "/v1/nodes")
        try:
            return _NODE_LIST.validate_python(data)
        except ValidationError as exc:
            raise self._malformed(exc) from exc

    def drain(self, node_id: str) -> NodeView:
        """``POST /v1/nodes/{id}/drain``."""
        return self._parse(NodeView, self._call("POST", _node_path(node_id)))

    def undrain(self, node_id: str) -> NodeView:
        """``DELETE /v1/nodes/{id}/drain``."""
        return self._parse(NodeView, self._call("DELETE", _node_path(node_id)))

    # plumbing --------------------------------------------------------------------------

    def _call(
        self, method: str, path: str, *, json: Any = None,
        params: Mapping[str, str | int] | None = None,
    ) -> Any:
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.TimeoutException as exc:
            raise ApiError(0, f"the coordinator at {self.url} did not answer within "
                              f"{self.timeout:g} s ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise ApiError(0, f"cannot reach the coordinator at {self.url}: {reason}") from exc
        if not response.is_success:
            raise self._refusal(response)
        try:
            return response.json()
        except ValueError as exc:
            raise ApiError(0, f"the coordinator at {self.url} answered {method} {path} "
                              "with something that is not JSON") from exc

    def _refusal(self, response: httpx.Response) -> ApiError:
        status = response.status_code
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            detail = body.get("detail")
            return ApiError(status, body["error"],
                            detail=detail if isinstance(detail, list) else None)
        text = " ".join(response.text.split())[:200]
        return ApiError(status, f"HTTP {status} from {self.url}"
                                + (f": {text}" if text else ""))

    def _malformed(self, exc: ValidationError) -> ApiError:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return ApiError(0, f"the coordinator at {self.url} sent an answer this client does "
                           f"not understand ({where}: {first['msg']}); are the versions the same?")

    def _parse(self, model: type[M], data: Any) -> M:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise self._malformed(exc) from exc


def dump_json(data: BaseModel | list[BaseModel] | dict[str, Any]) -> str:
    """Models (or lists of them) as the API's JSON, for ``--json`` output."""
    if isinstance(data, BaseModel):
        return data.model_dump_json(indent=2)
    if isinstance(data, list):
        return json.dumps([item.model_dump(mode="json") for item in data], indent=2)
    return json.dumps(data, indent=2, default=str)
