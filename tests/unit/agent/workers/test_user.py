"""The worker-user setting: who may use it, and what the shim prepares for the user."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from agent.workers.user import (
    ENV_WORKER_USER,
    WorkerUser,
    _let_through,
    check_setting,
    lookup,
    pin_worker_user,
    prepare_worker_files,
)


def test_no_worker_user_is_always_fine() -> None:
    assert check_setting(None, euid=1000) is None


def test_a_worker_user_needs_a_root_agent() -> None:
    with pytest.raises(ValueError, match=r"worker_user \(nobody\) needs the agent to run as "
                                         r"root.*this agent runs as uid 1000"):
        check_setting("nobody", euid=1000)
    assert check_setting("nobody", euid=0) == "nobody"


def test_an_unknown_user_or_root_is_refused() -> None:
    with pytest.raises(ValueError, match=r"worker_user \(no-such-user-x\): there is no such user"):
        check_setting("no-such-user-x", euid=0)
    with pytest.raises(ValueError, match=r"worker_user \(root\) is root"):
        lookup("root")


def test_the_agents_worker_user_wins_over_the_jobs_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_WORKER_USER, "someone-else")  # as a job's env would set it
    pin_worker_user("nobody")
    assert os.environ[ENV_WORKER_USER] == "nobody"
    pin_worker_user(None)
    assert ENV_WORKER_USER not in os.environ


def _nobody() -> WorkerUser:
    entry = pwd.getpwnam("nobody")
    return WorkerUser("nobody", entry.pw_uid, entry.pw_gid, (entry.pw_gid,), entry.pw_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to hand files to another user")
def test_the_shim_hands_the_worker_its_progress_dir_and_error_file_and_a_way_to_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = _nobody()
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    os.chown(logs, -1, user.gid)
    os.chmod(logs, 0o710)  # as agent.workers.logcap.private_log_dir leaves it
    private = logs / "job_abc"  # torch's mkdtemp
    private.mkdir(mode=0o700)
    rank = private / "attempt_0" / "0"
    rank.mkdir(parents=True, mode=0o755)
    os.chmod(rank, 0o755)
    progress = tmp_path / "progress"
    progress.mkdir()
    monkeypatch.setenv("TIDAL_PROGRESS_DIR", str(progress))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(rank / "error.json"))
    prepare_worker_files(user)
    assert (progress.stat().st_uid, progress.stat().st_mode & 0o777) == (user.uid, 0o700)
    error = rank / "error.json"
    assert (error.stat().st_uid, error.stat().st_mode & 0o777) == (user.uid, 0o600)
    # torch's private directory lets the user's group through; nothing else changed.
    assert (private.stat().st_gid, private.stat().st_mode & 0o777) == (user.gid, 0o710)
    assert rank.stat().st_uid == 0 and rank.stat().st_mode & 0o777 == 0o755
    assert logs.stat().st_mode & 0o777 == 0o710


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to hand files to another user")
def test_the_shim_refuses_a_symlink_or_a_tree_never_opened_to_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = _nobody()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "progress"
    link.symlink_to(target)
    monkeypatch.setenv("TIDAL_PROGRESS_DIR", str(link))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(OSError):
        prepare_worker_files(user)
    assert target.stat().st_uid == 0
    closed = tmp_path / "a" / "b" / "c" / "d" / "e" / "f" / "g"
    closed.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="no directory open to nobody's group"):
        _let_through(str(closed), user)
