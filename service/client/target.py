"""Where to find a tidal cluster: which coordinator to talk to, and with which token.

:func:`resolve_target` decides it for the command line and for a
:class:`service.client.sync.Client` built without a URL: flags (or arguments),
then ``TIDAL_URL`` / ``TIDAL_TOKEN`` / ``TIDAL_TOKEN_FILE``, then the
``cluster.json`` that ``tidal up`` writes into its state directory
(``$TIDAL_HOME``, else ``~/.tidal``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.client.errors import NotConfiguredError

CLUSTER_FILE = "cluster.json"
# The name this module's failures had before they joined service.client.errors.
TargetError = NotConfiguredError


class AgentEntry(BaseModel):
    """One agent of a local cluster, as ``tidal up`` records it."""

    model_config = ConfigDict(extra="ignore")

    node_id: str
    pid: int | None = None
    run_dir: Path
    metrics_port: int | None = None


class ClusterFile(BaseModel):
    """``STATE_DIR/cluster.json``: written by ``tidal up`` (service.up.cluster), read here."""

    model_config = ConfigDict(extra="ignore")

    url: str
    token_file: Path | None = None
    etcd_endpoint: str | None = None
    etcd_root: str | None = None
    etcd_password_files: dict[str, Path] = Field(default_factory=dict)
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
        NotConfiguredError: the file exists but cannot be read or is not a cluster file.
    """
    path = state_dir / CLUSTER_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise NotConfiguredError(f"cannot read the cluster file {path}: {exc}") from exc
    try:
        return ClusterFile.model_validate_json(text)
    except ValidationError as exc:
        fields = ", ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}"
            for err in exc.errors()[:3]
        )
        raise NotConfiguredError(f"the cluster file {path} is not valid ({fields})") from exc


def _read_token_file(path: Path, *, source: str) -> str:
    try:
        token = path.expanduser().read_text().strip()
    except OSError as exc:
        raise NotConfiguredError(
            f"cannot read the token file {path} (from {source}): {exc}") from exc
    if not token:
        raise NotConfiguredError(f"the token file {path} (from {source}) is empty")
    return token


def _check_url(url: str, *, source: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise NotConfiguredError(f"the coordinator URL {url!r} (from {source}) must start with "
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
        NotConfiguredError: no URL anywhere, an unreadable token or cluster file, or a
            URL that is not http(s).
    """
    env = os.environ if environ is None else environ
    state = state_dir if state_dir is not None else default_state_dir(env)
    cluster_path = state / CLUSTER_FILE
    try:
        cluster = load_cluster(state)
    except NotConfiguredError:
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
        raise NotConfiguredError(
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
