"""A job's working and checkpoint directories, checked where the runner uses them.

The coordinator confines ``working_dir`` and ``checkpoint_dir`` to its roots
when the job is submitted, and hands the agents the fully resolved absolute
path (every symlink resolved, see ``service.coordinator.routes.common.confine``). What lies on
disk may change after that: the directory may be missing, be a file, or a
component of it may have become a symbolic link leading out of the root.
So the runner opens the path again right before it uses it, one component at
a time and without following any symlink (``O_NOFOLLOW`` on each name, from
an open ``/``): since the recorded path had none, a symlink found now was
made after the job was submitted, and is refused, wherever it points. The
working directory is then entered through the open descriptor
(``fchdir``), so nothing can be swapped between the check and the use.

A refusal is a :class:`JobSetupError` whose message is the sentence the job's
status shows; no retry can fix it, so the runner reports the job FAILED.
"""

from __future__ import annotations

import errno
import os
import stat

# O_PATH: no read permission needed to walk through a directory; enough for fchdir.
_OPEN_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class JobSetupError(Exception):
    """The job cannot start on this node whatever is retried; the message says why."""


def _components(path: str, what: str) -> list[str]:
    if not os.path.isabs(path):
        raise JobSetupError(f"{what} {path} is not an absolute path")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise JobSetupError(f"{what} {path} is not a normalized path")
    return parts


def _refusal(path: str, prefix: str, what: str, parent: int, name: str, exc: OSError) -> str:
    """The sentence for a component ``name`` (``prefix`` so far) that could not be entered."""
    try:
        info = os.lstat(name, dir_fd=parent)
    except OSError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        try:
            target = os.readlink(name, dir_fd=parent)
        except OSError:
            target = "?"
        where = "" if prefix == path else f" ({prefix})"
        return (f"{what} {path}{where} is a symbolic link (to {target}), not the directory "
                "resolved when the job was submitted; refused (it could lead out of the "
                "allowed root)")
    if info is not None and not stat.S_ISDIR(info.st_mode):
        if prefix == path:
            return f"{what} {path} is not a directory"
        return f"{what} {path}: {prefix} is not a directory"
    if exc.errno == errno.ENOENT or info is None:
        if prefix == path:
            return f"{what} {path} does not exist"
        return f"{what} {path} does not exist ({prefix} is missing)"
    return f"{what} {path}: cannot enter {prefix}: {exc.strerror}"


def _walk(path: str, what: str, *, missing_ok: bool) -> int | None:
    """Open ``path`` one component at a time, never following a symlink.

    Returns the ``O_PATH`` descriptor, or None when ``missing_ok`` and a
    component does not exist (what exists is checked all the same).
    """
    parts = _components(path, what)
    fd = os.open("/", _OPEN_FLAGS | os.O_DIRECTORY)
    prefix = ""
    try:
        for name in parts:
            prefix += "/" + name
            try:
                child = os.open(name, _OPEN_FLAGS | os.O_DIRECTORY, dir_fd=fd)
            except FileNotFoundError as exc:
                if missing_ok:
                    os.close(fd)
                    return None
                raise JobSetupError(_refusal(path, prefix, what, fd, name, exc)) from exc
            except OSError as exc:
                raise JobSetupError(_refusal(path, prefix, what, fd, name, exc)) from exc
            os.close(fd)
            fd = child
            # O_DIRECTORY already refuses a symlink (O_NOFOLLOW would otherwise
            # open the link itself); check the type anyway: this is the point.
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise JobSetupError(f"{what} {path}: {prefix} is not a directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_directory(path: str, *, what: str) -> int:
    """Open the directory ``path`` without following a symlink in any component.

    Args:
        path: an absolute, normalized path.
        what: how messages name it ("working directory").

    Returns:
        An ``O_PATH`` descriptor of the directory; the caller closes it.

    Raises:
        JobSetupError: the path is missing, is not a directory, has a symlink
            in it, or cannot be entered.
    """
    fd = _walk(path, what, missing_ok=False)
    assert fd is not None  # missing_ok=False raises instead
    return fd


def enter_directory(path: str, *, what: str = "working directory") -> None:
    """``chdir`` into ``path``, checked by :func:`open_directory`, through its descriptor.

    Raises:
        JobSetupError: see :func:`open_directory`.
    """
    fd = open_directory(path, what=what)
    try:
        os.fchdir(fd)
    except OSError as exc:
        raise JobSetupError(f"{what} {path}: cannot enter it: {exc.strerror}") from exc
    finally:
        os.close(fd)


def check_directory(path: str, *, what: str = "checkpoint directory") -> None:
    """Check the part of ``path`` that exists as :func:`open_directory` does.

    A directory the job's workers create (a checkpoint directory on its first
    save) may be missing; they create it as themselves, which matters when the
    workers run as another user than the agent.

    Raises:
        JobSetupError: an existing component is a symlink or not a directory.
    """
    fd = _walk(path, what, missing_ok=True)
    if fd is not None:
        os.close(fd)


def check_job_paths(cwd: str | None, checkpoint_dir: str | None) -> None:
    """Both of a job's directories as the runner will use them (the daemon's early check).

    Raises:
        JobSetupError: see :func:`open_directory`.
    """
    if cwd:
        os.close(open_directory(cwd, what="working directory"))
    if checkpoint_dir:
        check_directory(checkpoint_dir, what="checkpoint directory")
