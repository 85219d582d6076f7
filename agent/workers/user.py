"""Run a job's workers as another user than the agent's (``--worker-user``).

By default a job's workers run as the agent's user: they can read whatever
it can, the coordinator's token in ``tidal up``'s state directory included.
An agent that runs as root can instead run every worker as an unprivileged
user (``--worker-user NAME``, ``TIDAL_WORKER_USER``), while the daemon and
the job runners, which hold the etcd credentials, stay root:

* the daemon passes the name to each runner in ``TIDAL_WORKER_USER``; the
  runner keeps it whatever the job's environment says
  (:func:`agent.runner.prepare_environment`);
* the runner starts the job's zygote as that user (:mod:`agent.workers.zygote`), so
  every worker it forks is that user's;
* every worker shim (:mod:`agent.workers.shim`), started by the runner as
  root, first prepares what the worker must write (its progress directory,
  torch's error file) and then becomes the user (:func:`become`:
  supplementary groups, group, user; no shell, no ``su``) before it sets
  its parent-death signal (a change of user clears it) and before it asks
  the zygote for a worker or ``exec``\\s the command.

The run directory stays the agent's: mode 0710 with the worker user's group,
so a worker can reach its job's progress directory and error file, and
nothing else there (logs are 0600, runner specs 0600). Any failure to become
the user ends the shim with code 126: a worker never runs as root by mistake.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from checkpoints.protocol import env as worker_env

ENV_WORKER_USER = worker_env.WORKER_USER
#: torch elastic's variable naming a worker's error file (its ``@record``).
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: checkpoints.progress's variable naming the job's progress directory.
ENV_PROGRESS_DIR = worker_env.PROGRESS_DIR


class WorkerUserError(RuntimeError):
    """The workers cannot run as the configured user."""


@dataclass(frozen=True)
class WorkerUser:
    """An account the workers run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def lookup(name: str) -> WorkerUser:
    """The account ``name``, with its supplementary groups.

    Raises:
        ValueError: no such user, or it is root (uid 0).
    """
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"worker_user ({name}): there is no such user") from None
    if entry.pw_uid == 0:
        raise ValueError(f"worker_user ({name}) is root: workers would run as root")
    groups = tuple(sorted(set(os.getgrouplist(name, entry.pw_gid))))
    return WorkerUser(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def check_setting(name: str | None, *, euid: int) -> str | None:
    """Validate the agent's ``worker_user`` setting for a process of ``euid``.

    Raises:
        ValueError: naming the user and why it cannot be used.
    """
    if name is None:
        return None
    lookup(name)
    if euid != 0:
        raise ValueError(
            f"worker_user ({name}) needs the agent to run as root, to start workers as that "
            f"user; this agent runs as uid {euid}"
        )
    return name


def from_env() -> WorkerUser | None:
    """The worker user the daemon named for this runner, if any.

    Raises:
        WorkerUserError: the named user cannot be used.
    """
    name = os.environ.get(ENV_WORKER_USER)
    if not name:
        return None
    try:
        return lookup(name)
    except ValueError as exc:
        raise WorkerUserError(str(exc)) from exc


def pin_worker_user(name: str | None) -> None:
    """Set ``TIDAL_WORKER_USER`` back to the agent's ``name`` (or remove it),
    whatever a job's environment just set it to."""
    if name:
        os.environ[ENV_WORKER_USER] = name
    else:
        os.environ.pop(ENV_WORKER_USER, None)


def user_env(user: WorkerUser) -> dict[str, str]:
    """What a login would set for ``user``: its home and names."""
    return {"HOME": user.home, "USER": user.name, "LOGNAME": user.name}


def become(user: WorkerUser) -> None:
    """Switch this process to ``user`` for good (real, effective and saved ids).

    Raises:
        WorkerUserError: the switch failed or could be undone.
    """
    try:
        os.setgroups(list(user.groups))
        os.setresgid(user.gid, user.gid, user.gid)
        os.setresuid(user.uid, user.uid, user.uid)
    except OSError as exc:
        raise WorkerUserError(f"cannot become {user.name} (uid {user.uid}): {exc}") from exc
    if os.getresuid() != (user.uid,) * 3 or os.getresgid() != (user.gid,) * 3:
        raise WorkerUserError(f"cannot become {user.name}: the ids did not all change")
    with contextlib.suppress(PermissionError):
        os.setuid(0)
        raise WorkerUserError(f"{user.name} could become root again")
    os.environ.update(user_env(user))


def private_dir(path: Path, user: WorkerUser | None) -> None:
    """Create ``path`` (and parents) and make it the agent's own: mode 0700, or
    0710 with ``user``'s group, so that its workers can pass through it."""
    path.mkdir(parents=True, exist_ok=True)
    if user is None:
        os.chmod(path, 0o700)
    else:
        os.chown(path, -1, user.gid)
        os.chmod(path, 0o710)  # noqa: S103  (the worker user's group may pass through)


def _give(path: str, user: WorkerUser, *, directory: bool) -> None:
    """Hand ``path`` (created by us, root) to ``user``; never through a symlink."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if directory else 0)
    if not directory:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o600)
    try:
        info = os.fstat(fd)
        if directory != stat.S_ISDIR(info.st_mode) or not (
            directory or stat.S_ISREG(info.st_mode)
        ):
            raise WorkerUserError(f"{path} is not a plain {'directory' if directory else 'file'}")
        if info.st_uid != user.uid:
            os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, 0o700 if directory else 0o600)
    finally:
        os.close(fd)


def _passable(info: os.stat_result, user: WorkerUser) -> bool:
    mode = info.st_mode
    return bool(mode & stat.S_IXOTH) or (info.st_gid == user.gid and bool(mode & stat.S_IXGRP))


def _let_through(directory: str, user: WorkerUser, *, levels: int = 6) -> None:
    """Let ``user``'s group pass through ``directory`` and the ones above it that
    torch made private (its ``mkdtemp``), up to the job's log directory, which
    :func:`agent.workers.logcap.private_log_dir` already opened to that group."""
    path = os.path.abspath(directory)
    for _ in range(levels):
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode):
            raise WorkerUserError(f"{path} is not a plain directory")
        if info.st_gid == user.gid and info.st_mode & stat.S_IXGRP:
            return  # the log directory (or one already opened): above it is the agent's
        if not _passable(info, user):  # root's, made by torch: the user cannot swap it
            os.chown(path, -1, user.gid)
            os.chmod(path, stat.S_IMODE(info.st_mode) | stat.S_IXGRP)  # noqa: S103  (passage)
        path = os.path.dirname(path)
    raise WorkerUserError(f"no directory open to {user.name}'s group above {directory}")


def prepare_worker_files(user: WorkerUser) -> None:
    """In the shim, still root: give ``user`` what its worker writes.

    The job's progress directory (the worker's progress reports) and the
    worker's error file (torch's ``@record`` writes its traceback there, by
    path): both were made by the runner, as root, in directories the user
    may pass through but not change.
    """
    progress = os.environ.get(ENV_PROGRESS_DIR)
    if progress:
        _give(progress, user, directory=True)
    error_file = os.environ.get(ENV_ERROR_FILE)
    if error_file:
        _let_through(os.path.dirname(error_file), user)
        _give(error_file, user, directory=False)


def switch_from_env() -> None:
    """In the shim: become the worker user the daemon named, if any.

    Raises:
        WorkerUserError: it is named but this process cannot become it.
    """
    user = from_env()
    if user is None or os.geteuid() == user.uid:
        return
    if os.geteuid() != 0:
        raise WorkerUserError(
            f"cannot become {user.name}: this process runs as uid {os.geteuid()}, not root"
        )
    prepare_worker_files(user)
    become(user)
