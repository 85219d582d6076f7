"""The runner's checks of a job's directories where it uses them (agent.workers.jobpaths)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.spec import job_command
from agent.workers.jobpaths import JobSetupError, check_directory, enter_directory, open_directory


@pytest.fixture
def root(tmp_path: Path) -> Path:
    real = Path(os.path.realpath(tmp_path))
    (real / "run1").mkdir()
    (real / "file").write_text("x")
    (real / "outside").mkdir()
    (real / "root").mkdir()
    return real


def _refused(path: Path | str, **kw: object) -> str:
    with pytest.raises(JobSetupError) as info:
        os.close(open_directory(str(path), what="working directory", **kw))  # type: ignore[arg-type]
    return str(info.value)


def test_an_existing_directory_is_opened(root: Path):
    fd = open_directory(str(root / "run1"), what="working directory")
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(root / "run1"))
    finally:
        os.close(fd)


def test_a_missing_directory_is_refused_with_its_name(root: Path):
    assert _refused(root / "exprs") == f"working directory {root}/exprs does not exist"
    assert _refused(root / "exprs" / "run1") == (
        f"working directory {root}/exprs/run1 does not exist ({root}/exprs is missing)")


def test_a_file_is_refused(root: Path):
    assert _refused(root / "file") == f"working directory {root}/file is not a directory"
    assert "is not a directory" in _refused(root / "file" / "x")


def test_a_symlink_anywhere_in_the_path_is_refused_even_one_that_stays_inside(root: Path):
    (root / "root" / "out").symlink_to("/etc")
    (root / "root" / "in").symlink_to(root / "run1")
    message = _refused(root / "root" / "out")
    assert "is a symbolic link (to /etc)" in message
    assert "refused" in message
    assert "symbolic link" in _refused(root / "root" / "out" / "ssl")
    assert "symbolic link" in _refused(root / "root" / "in")


def test_relative_or_unnormalized_paths_are_refused(root: Path):
    assert "not an absolute path" in _refused("run1")
    assert "not a normalized path" in _refused(f"{root}/run1/../outside")


def test_enter_directory_changes_into_it(root: Path):
    before = os.getcwd()
    try:
        enter_directory(str(root / "run1"))
        assert os.path.samefile(os.getcwd(), root / "run1")
    finally:
        os.chdir(before)


def test_a_checkpoint_directory_may_be_missing_but_not_reached_through_a_symlink(root: Path):
    check_directory(str(root / "ckpt" / "a" / "b"))  # the workers create it
    check_directory(str(root / "run1"))
    assert not (root / "ckpt").exists()
    (root / "root" / "evil").symlink_to(root / "outside")
    with pytest.raises(JobSetupError, match="symbolic link"):
        check_directory(str(root / "root" / "evil" / "ckpt"))
    with pytest.raises(JobSetupError, match="not a directory"):
        check_directory(str(root / "file" / "ckpt"))


def test_bare_python_means_the_runners_interpreter():
    py = "/opt/venv/bin/python"
    assert job_command(["python", "t.py", "--x"], py) == [py, "t.py", "--x"]
    assert job_command(["python3", "-m", "m"], py) == [py, "-m", "m"]
    for kept in (["/usr/bin/python3", "t.py"], ["python3.12", "t.py"], ["env", "python", "t"],
                 ["./python", "t.py"], ["bash", "-c", "python t.py"]):
        assert job_command(kept, py) == kept
