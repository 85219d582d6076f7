"""Pre-started workers: the zygote forks scripts with torch imported, and dies right."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.workers.zygote import (
    ENV_PRELOAD,
    ENV_SOCKET,
    ZygoteProcess,
    new_address,
    parse_command,
    run_through,
)
from tests.support.wait import wait_for

SCRIPT = """
import json, logging, os, signal, sys, time
logging.basicConfig(format="worker-format %(message)s", level=logging.INFO)
logging.getLogger("w").info("hello")
preloaded = "torch" in sys.modules
import torch
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("WORKER_VAR"),
                  "preloaded": preloaded, "pid": os.getpid(), "name": __name__}), flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


def test_only_commands_of_this_interpreter_are_taken() -> None:
    py = sys.executable
    assert parse_command([py, "train.py", "--x"], py) == ("path", "train.py", ["train.py", "--x"])
    assert parse_command([py, "-u", "-m", "pkg.mod", "a"], py) == ("module", "pkg.mod",
                                                                     ["pkg.mod", "a"])
    assert parse_command([py, "-c", "print(1)"], py) is None
    assert parse_command([py, "-X", "dev", "train.py"], py) is None
    assert parse_command(["/bin/echo", "hi"], py) is None
    assert parse_command([py], py) is None


@pytest.fixture(scope="module")
def zygote() -> Iterator[ZygoteProcess]:
    process = ZygoteProcess(os.getpid())
    try:
        assert process.wait_ready(120), "the zygote never became ready"
        yield process
    finally:
        process.close()


def _shim(zygote: ZygoteProcess, tmp_path: Path, command: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, ENV_SOCKET: zygote.path, "WORKER_VAR": "w1"}
    out = open(tmp_path / "out.log", "wb")  # noqa: SIM115  (closed by the caller's process end)
    return subprocess.Popen(
        [sys.executable, "-m", "agent.workers.shim", str(os.getpid()), "--", *command],
        env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _record(tmp_path: Path) -> dict[str, object] | None:
    import json

    for line in (tmp_path / "out.log").read_text().splitlines():
        if line.startswith("{"):
            return dict(json.loads(line))
    return None


def test_a_script_runs_forked_with_torch_imported_and_its_exit_code(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    shim = _shim(zygote, tmp_path, [sys.executable, "job.py", "7"])
    assert shim.wait(60) == 7
    record = _record(tmp_path)
    assert record is not None
    assert record["preloaded"] is True
    assert record["argv"] == ["job.py", "7"]
    assert record["cwd"] == str(tmp_path)
    assert record["env"] == "w1"
    assert record["name"] == "__main__"
    assert "worker-format hello" in (tmp_path / "out.log").read_text()  # its own logging
    assert record["pid"] != shim.pid


def test_the_worker_shows_its_own_command(zygote: ZygoteProcess, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    shim = _shim(zygote, tmp_path, [sys.executable, "job.py", "wait"])
    try:
        record = wait_for(lambda: _record(tmp_path), timeout=60, what="the worker to start")
        cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes()
        assert b"job.py wait" in cmdline and b"agent.workers.zygote" not in cmdline
        # The environment block is untouched: tools that look for a node's
        # processes by their environment still find the worker.
        environ = Path(f"/proc/{record['pid']}/environ").read_bytes().split(b"\0")
        assert any(var.startswith(b"PATH=") for var in environ)
    finally:
        os.killpg(shim.pid, signal.SIGKILL)
        shim.wait(30)


def test_sigterm_reaches_the_worker_and_sigkill_of_the_shim_kills_it(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    shim = _shim(zygote, tmp_path, [sys.executable, "job.py", "wait"])
    record = wait_for(lambda: _record(tmp_path), timeout=60, what="the worker to start")
    os.killpg(shim.pid, signal.SIGTERM)  # what torch elastic sends
    assert shim.wait(30) == -signal.SIGTERM
    wait_for(lambda: not _alive(int(record["pid"])), timeout=10, what="the worker to end")

    (tmp_path / "out.log").unlink()
    shim = _shim(zygote, tmp_path, [sys.executable, "job.py", "wait"])
    record = wait_for(lambda: _record(tmp_path), timeout=60, what="the worker to start")
    os.kill(int(record["pid"]), signal.SIGKILL)  # the worker dies: torch sees how
    assert shim.wait(30) == -signal.SIGKILL

    (tmp_path / "out.log").unlink()
    shim = _shim(zygote, tmp_path, [sys.executable, "job.py", "wait"])
    record = wait_for(lambda: _record(tmp_path), timeout=60, what="the worker to start")
    os.killpg(shim.pid, signal.SIGKILL)  # torch's last resort: the worker must follow
    shim.wait(30)
    wait_for(lambda: not _alive(int(record["pid"])), timeout=10, what="the orphan to die")


def test_a_command_the_zygote_refuses_is_executed_as_before(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    shim = _shim(zygote, tmp_path, ["/bin/sh", "-c", "echo plain; exit 5"])
    assert shim.wait(30) == 5
    assert (tmp_path / "out.log").read_text().strip() == "plain"


# A module of the job's that records the process that imported it.
MARKED = """
import os
open(os.path.join(os.path.dirname(__file__), f"imported-in-{os.getpid()}"), "w").close()
"""
# A worker that looks for it before importing it (a second import would be its own).
FINDS_PRELOADED = """
import json, os, sys
found = "tidal_marked" in sys.modules
import tidal_marked
print(json.dumps({"found": found, "zygote": os.getppid()}), flush=True)
"""


def test_the_jobs_preload_modules_are_imported_by_the_zygote_before_its_workers_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """What a job's zygote_preload becomes on the node (TIDAL_ZYGOTE_PRELOAD): a name
    that is not a module name is never imported, a module that fails is logged, and
    the zygote goes on to import the rest."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "tidal_marked.py").write_text(MARKED)
    (lib / "tidal_boom.py").write_text("raise RuntimeError('boom at import')\n")
    (lib / "tidal_exits.py").write_text("raise SystemExit(3)\n")
    # A file importlib would import, under a name the pattern refuses (not ASCII).
    (lib / "tidal_caf\u00e9.py").write_text("open(__file__ + '.imported', 'w').close()\n")
    (tmp_path / "worker.py").write_text(FINDS_PRELOADED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(lib), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv(ENV_PRELOAD, "tidal_caf\u00e9,tidal_boom,no_such_module,tidal_exits,"
                                    "tidal_marked")
    zygote = ZygoteProcess(os.getpid())
    try:
        assert zygote.wait_ready(120), "the zygote never became ready"
        assert zygote._proc is not None
        # It imports them after torch's later modules, while no worker waits.
        marks = wait_for(lambda: sorted(lib.glob("imported-in-*")), timeout=180,
                         what="the zygote to import tidal_marked")
        assert marks == [lib / f"imported-in-{zygote._proc.pid}"]
        shim = _shim(zygote, tmp_path, [sys.executable, "worker.py"])
        assert shim.wait(60) == 0, (tmp_path / "out.log").read_text()
        record = _record(tmp_path)
        assert record == {"found": True, "zygote": zygote._proc.pid}
        # The worker did not import it again: the zygote's mark is still the only one.
        assert sorted(lib.glob("imported-in-*")) == marks
        assert zygote._proc.poll() is None
        assert not (lib / "tidal_caf\u00e9.py.imported").exists()
    finally:
        zygote.close()
    log = capfd.readouterr().err
    assert "not preloading 'tidal_caf\u00e9'" in log
    assert "cannot preload tidal_boom: RuntimeError: boom at import" in log
    assert "cannot preload no_such_module: ModuleNotFoundError" in log
    assert "cannot preload tidal_exits: SystemExit: 3" in log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as gone: the zygote reaps it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# A runner that starts a zygote, says "ready" once it listens, then waits.
RUNNER = """
import os, sys, time
from agent.workers.zygote import ZygoteProcess
zygote = ZygoteProcess(os.getpid())
assert zygote.wait_ready(120)
print(zygote.path, flush=True)
time.sleep(600)
"""


def _zygote_of(runner: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == runner and b"agent.workers.zygote" in argv:
            return int(entry.name)
    return None


def test_a_zygote_and_its_runner_killed_leave_no_file_behind(tmp_path: Path) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    out = tmp_path / "runner.out"
    with open(out, "wb") as stdout:
        runner = subprocess.Popen(
            [sys.executable, "-c", RUNNER], stdout=stdout, stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(private_tmp)}, start_new_session=True,
        )
    try:
        address = wait_for(  # the zygote's log goes there too
            lambda: [w for w in out.read_text().split() if w.startswith("@")][-1:],
            timeout=120, what="the zygote ready")[0]
        # Abstract: a name, not a path; the socket exists though no file does.
        assert address.startswith("@tidal-zygote-") and len(address) == len("@tidal-zygote-") + 32
        assert address in Path("/proc/net/unix").read_text()
        zygote = _zygote_of(runner.pid)
        assert zygote is not None
        os.kill(zygote, signal.SIGKILL)  # the zygote dies first...
        wait_for(lambda: not _alive(zygote), timeout=10, what="the zygote gone")
        os.killpg(runner.pid, signal.SIGKILL)  # ...then its runner, which cannot clean up
        runner.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait(30)
    assert list(private_tmp.iterdir()) == []
    # The kernel drops the socket once the zygote's last thread has exited (its
    # main thread shows as a zombie before its other thread, torch's, is gone).
    wait_for(lambda: address not in Path("/proc/net/unix").read_text(), timeout=30,
             what="the zygote's socket gone with it")


def test_a_shim_does_not_talk_to_a_socket_of_another_user(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root, to listen as another user")
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None:
        pytest.skip("no system python3 that another user may run")
    address = new_address()
    # A process of another user (nobody) listens under the name first.
    squatter = subprocess.Popen(
        [system_python, "-c",
         "import socket, sys, time\n"
         "s = socket.socket(socket.AF_UNIX)\n"
         f"s.bind('\\0' + {address[1:]!r}); s.listen(1); print('up', flush=True)\n"
         "c, _ = s.accept(); print('connected', flush=True); time.sleep(60)\n"],
        user=65534, group=65534, extra_groups=[], stdout=subprocess.PIPE,
    )
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().strip() == b"up"
        # The shim connects, sees the peer is not of its user, and sends nothing.
        assert run_through(address, [sys.executable, "-c", "pass"]) is None
    finally:
        squatter.kill()
        squatter.wait(10)


def test_a_zygote_runs_as_the_worker_user_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root, to start the zygote as another user")
    import pwd

    monkeypatch.setenv("TIDAL_WORKER_USER", "nobody")
    process = ZygoteProcess(os.getpid())
    try:
        if process.wait_ready(120):  # the worker user may run this interpreter
            assert process._proc is not None
            status = Path(f"/proc/{process._proc.pid}/status").read_text()
            uid = pwd.getpwnam("nobody").pw_uid
            assert f"Uid:\t{uid}\t{uid}\t{uid}" in status
        else:  # it may not (a virtual environment under /root): no zygote, no error
            assert process._proc is None or process._proc.poll() is not None
    finally:
        process.close()
    process.close()  # twice is harmless
