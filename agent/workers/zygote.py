"""Pre-started workers: a process that has imported torch and forks each worker.

A restarted worker used to spend most of its start-up importing torch (about
1.4 s on the 2-core benchmark machine, 3 s with the first optimizer's
``torch._dynamo`` import). The runner therefore starts one *zygote* per job
before the first rendezvous: ``python -m agent.workers.zygote SOCKET RUNNER_PID``,
with the job's environment. It imports torch and what every DDP script uses,
then serves on an abstract Unix socket (no file, so nothing is left behind
however it ends; see :func:`new_address`), and imports the rest (``torch.optim``,
``torch._dynamo``, ``checkpoints``, then the job's ``zygote_preload`` modules,
which the runner puts in ``TIDAL_ZYGOTE_PRELOAD``; see :func:`preload_names`)
whenever no worker is waiting. For each
worker that torch elastic starts,
:mod:`agent.workers.shim` (the process torch tracks and signals) connects,
sends the command, environment and working directory as JSON with its stdin,
stdout and stderr as file descriptors (``SCM_RIGHTS``), and the zygote forks
a child that runs the script in-process (``runpy``), as ``python`` would.

Only commands the zygote can run exactly as ``python`` would are taken:
``PYTHON [-u] SCRIPT ARGS`` or ``PYTHON [-u] -m MODULE ARGS`` where PYTHON is
the zygote's own interpreter. Anything else (another interpreter, other
options, a shell script, a binary) is refused and the shim ``exec``\\s the
command as before. So is everything when the zygote is not there (it died,
or ``TIDAL_ZYGOTE=0`` in the job's environment turned it off).

Protocol on the connection, one JSON line each way, then:

* zygote -> shim: ``{"pid": N}`` once the child runs, or ``{"refused": why}``;
* zygote -> shim: ``{"exit": CODE}`` (``-SIG`` for a signal) when it ends.

Life and death: the shim relays SIGTERM, SIGINT and SIGHUP to the child; the
child gets the parent-death signal from the zygote (which dies with the
runner), and kills itself when its shim's connection closes (torch SIGKILLed
the shim). The zygote is single-threaded when it forks (its Python code);
``import torch`` leaves one idle native thread, as in every DataLoader worker
torch forks the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import runpy
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from agent.workers.lifeline import die_with_parent
from checkpoints.protocol import env as worker_env

log = logging.getLogger("tidal.zygote")

ENV_SOCKET = worker_env.ZYGOTE_SOCKET
ENV_SWITCH = worker_env.ZYGOTE  # "0" in a job's environment: no zygote
ENV_PRELOAD = worker_env.ZYGOTE_PRELOAD  # extra modules to import, comma-separated
# Imported before the zygote says it is ready: what every DDP script needs.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel")
# Imported afterwards, while no worker is waiting: a new node joins its job
# sooner, and only a worker forked before these are in pays for them itself.
PRELOAD_LATER = (
    "torch.optim",
    "torch._dynamo",  # what the first optimizer step imports: 1.3 s
    "torch.distributed.elastic.multiprocessing.errors",
    "checkpoints",
    # The checkpointer (and torch.distributed.checkpoint under it, 0.3-1 s): a worker
    # that joins a running group live makes its checkpointer while the others wait.
    "checkpoints.checkpointer",
)
#: What a name in ENV_PRELOAD must look like to be imported: a dotted module
#: name of ASCII identifiers (rendezvous.records.MODULE_NAME_PATTERN, which the
#: coordinator checks at submit; repeated here so the zygote starts without pydantic).
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_MODULE_NAME_LEN = 200
MAX_REQUEST = 4 << 20
# An ignored last argument: the room a forked worker's title may take.
TITLE_ROOM = "-" * 512


def parse_command(command: list[str], python: str) -> tuple[str, str, list[str]] | None:
    """``("path", SCRIPT, argv)`` or ``("module", NAME, argv)`` if the zygote
    can run ``command`` exactly as ``python`` would, else None."""
    if not command:
        return None
    exe = command[0]
    if os.sep in exe:
        resolved = exe
    else:
        import shutil

        resolved = shutil.which(exe) or ""
    if not resolved or os.path.realpath(resolved) != os.path.realpath(python):
        return None
    rest = command[1:]
    while rest and rest[0] == "-u":  # unbuffered: the workers run with PYTHONUNBUFFERED
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], [rest[1], *rest[2:]]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest
    return None


def preload_names(text: str) -> tuple[list[str], list[str]]:
    """The modules of ``text`` (``ENV_PRELOAD``'s comma-separated value) to import,
    and the entries refused because they are not dotted module names.

    The coordinator checked the job's list already; this is the check where the
    names are used, so that nothing but a module name ever reaches ``import``.
    """
    names: list[str] = []
    refused: list[str] = []
    for entry in text.split(","):
        name = entry.strip()
        if not name:
            continue
        if len(name) <= MAX_MODULE_NAME_LEN and MODULE_NAME.fullmatch(name):
            if name not in names:
                names.append(name)
        else:
            refused.append(name)
    return names, refused


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _run_child(conn: socket.socket, fds: list[int], request: dict[str, Any],
               parsed: tuple[str, str, list[str]], *, zygote: int, inherited: list[int]) -> None:
    """In the forked child: become the worker and run its script. Never returns."""
    kind, target, argv = parsed
    code = 1
    try:
        die_with_parent(expected_parent=zygote, sig=signal.SIGKILL)
        os.setsid()  # leave the zygote's process group: signals for it are not ours
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log.handlers.clear()  # the worker's logging starts as python's would
        log.propagate = True
        log.setLevel(logging.NOTSET)
        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        for fd in inherited:  # the zygote's other sockets are not this worker's
            with contextlib.suppress(OSError):
                os.close(fd)
        for target_fd, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target_fd)
            os.close(fd)

        def watch_shim() -> None:
            # Our shim is what torch signals; if it dies (SIGKILL), so do we.
            with contextlib.suppress(OSError):
                while conn.recv(4096):
                    pass
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch_shim, name="tidal-shim-watch", daemon=True).start()
        try:  # ps and /proc/PID/cmdline show the worker's command, not the zygote's
            import setproctitle

            setproctitle.setproctitle(" ".join(request["command"]))
        except ImportError:
            pass
        os.chdir(request.get("cwd") or os.getcwd())
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            import torch

            torch.set_num_threads(int(threads))
        sys.argv = argv
        if kind == "path":
            sys.path[0] = str(Path(target).resolve().parent)
            runpy.run_path(target, run_name="__main__")
        else:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        # As python would: the excepthook (checkpoints' just-in-time save hooks it).
        with contextlib.suppress(BaseException):
            sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code & 0xFF)


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(5)  # a shim sends its request at once; never hang the zygote
    uid = peer_uid(conn)
    if uid != os.getuid():
        raise ValueError(f"a process of uid {uid} may not start workers here")
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    try:
        while not data.endswith(b"\n"):
            more = conn.recv(MAX_REQUEST)
            if not more or len(data) > MAX_REQUEST:
                raise ValueError("the request ended early or is too long")
            data += more
        conn.settimeout(None)
        return dict(json.loads(data)), fds
    except Exception:
        for fd in fds:
            os.close(fd)
        raise


def new_address() -> str:
    """A fresh, unguessable address for a zygote's socket, in Linux's abstract
    namespace (``@`` stands for its leading NUL byte, which no environment
    variable can hold). An abstract socket has no file: nothing is left
    behind however the zygote and its runner end."""
    return f"@tidal-zygote-{secrets.token_hex(16)}"


def _sockaddr(address: str) -> str:
    """``address`` as ``bind``/``connect`` take it: ``@NAME`` is abstract, else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class Zygote:
    """The serving loop: one thread, a selector on the socket and SIGCHLD.

    Its socket is abstract (see :func:`new_address`), so the file system does
    not keep other users out: both ends check the other's user id instead
    (``SO_PEERCRED``). A shim only talks to a zygote of its own user, and a
    zygote only forks workers for one.
    """

    def __init__(self, path: str, python: str) -> None:
        self.python = python
        self.children: dict[int, socket.socket] = {}
        self.refusing = False
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.server.bind(_sockaddr(path))
        if not path.startswith("@"):
            os.chmod(path, 0o600)
        self.server.listen(64)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def serve_forever(self, later: tuple[str, ...] = ()) -> None:
        """Serve shims; import the modules of ``later`` one by one while none waits.

        A shim that comes before they are all imported waits until they are: its
        worker would import them itself anyway (the checkpointer, the first optimizer
        step), and after its ``init_process_group``, while the ranks of a running job
        it joins live wait for it in their first collectives; imported here, before
        the worker starts, they cost those ranks nothing (they train on until the
        joiner waits in the new group, :mod:`checkpoints.live`), and every later
        worker has them."""
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(self.server, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        pending = list(later)
        while True:
            events = selector.select(0 if pending else None)
            if not events and pending:
                if not _preload(pending.pop(0)):
                    self.refusing = True  # running workers stay; new ones are exec'ed
                continue
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    while pending:
                        if not _preload(pending.pop(0)):
                            self.refusing = True
                    self._accept()
            self._reap()

    def _accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                _send(conn, {"refused": f"bad request: {exc}"})
            conn.close()
            return
        parsed = None
        if isinstance(request.get("command"), list) and isinstance(request.get("env"), dict):
            parsed = parse_command([str(a) for a in request["command"]], self.python)
        if parsed is None or len(fds) != 3 or self.refusing:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                _send(conn, {"refused": "not a script or module of this interpreter"})
            conn.close()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        inherited = [self.server.fileno(), self._wake_r.fileno(), self._wake_w.fileno(),
                     *(c.fileno() for c in self.children.values())]
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            _run_child(conn, fds, request, parsed, zygote=zygote, inherited=inherited)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        with contextlib.suppress(OSError):
            _send(conn, {"pid": pid})

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3) or not argv[1].isdigit():
        sys.stderr.write("usage: python -m agent.workers.zygote SOCKET RUNNER_PID [TITLE_ROOM]\n")
        raise SystemExit(2)
    die_with_parent(expected_parent=int(argv[1]))
    # Our own handler, not the root logger's: a forked worker's logging
    # must start as a fresh interpreter's does (its basicConfig must work).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s zygote: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    extra, refused = preload_names(os.environ.get(ENV_PRELOAD, ""))
    for name in refused:
        log.warning("not preloading %r from %s: not a dotted module name", name[:80], ENV_PRELOAD)
    # A CUDA context must not exist before fork (the children could not use
    # CUDA): any "is CUDA available?" during the imports asks NVML instead.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not all(_preload(module) for module in PRELOAD):
        raise SystemExit(1)  # the shims find no zygote and exec the command
    zygote = Zygote(argv[0], sys.executable)
    log.info("zygote ready on %s", argv[0])
    # Tell the runner, then let go of the pipe: fd 1 becomes the log stream.
    os.write(1, b"ready\n")
    os.dup2(2, 1)
    zygote.serve_forever(later=(*PRELOAD_LATER, *extra))


def _preload(module: str) -> bool:
    """Import ``module``; False if that left a CUDA context (no fork is safe then).

    A module that cannot be imported (missing, or its code raises, even
    ``SystemExit``) is logged and skipped: it only costs the workers speed.
    """
    import importlib

    try:
        importlib.import_module(module)
    except (Exception, SystemExit) as exc:
        log.warning("cannot preload %s: %s: %s", module, type(exc).__name__, exc)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        log.error("CUDA was initialised while preloading %s: not forking workers", module)
        return False
    return True


class ZygoteProcess:
    """The runner's handle on its zygote: started at once, ready when it listens.

    Where the agent names a worker user (:mod:`agent.workers.user`), the
    zygote runs as that user, and so does every worker it forks. If it cannot
    be started, there is none: the shims find nobody at its address and
    ``exec`` the command.
    """

    def __init__(self, runner_pid: int) -> None:
        from agent.workers.user import from_env, user_env

        self.path = new_address()  # abstract: no file to remove, even after a SIGKILL
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            user = from_env()
            as_user: dict[str, Any] = {}
            env = {**os.environ, "SPT_NOENV": "1"}
            if user is not None:
                as_user = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
                env.update(user_env(user))
            self._proc = subprocess.Popen(  # a fixed argv, never a shell
                [sys.executable, "-m", "agent.workers.zygote", self.path, str(runner_pid),
                 TITLE_ROOM],
                stdin=subprocess.DEVNULL,
                # setproctitle may then use only the argument area (TITLE_ROOM is
                # its room), and /proc/PID/environ stays readable for tools.
                env=env,
                stdout=subprocess.PIPE,  # one line, "ready", once it listens
                **as_user,
            )
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("cannot start the zygote (%s): workers start without it", exc)

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the zygote listens (True), dies or ``timeout_s`` passes."""
        import selectors

        if self._proc is None:
            return False
        assert self._proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                return False
        return self._proc.stdout.readline().strip() == b"ready"

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def spawn_request(command: list[str], env: dict[str, str], cwd: str) -> bytes:
    """The request line a shim sends."""
    return json.dumps({"command": command, "env": env, "cwd": cwd}).encode() + b"\n"


def run_through(path: str, command: list[str]) -> int | None:
    """In the shim: have the zygote run ``command``; its exit code, or None if refused.

    Relays SIGTERM, SIGINT and SIGHUP to the child while it runs.
    """
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SOCKET,)}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_sockaddr(path))
        if peer_uid(conn) != os.getuid():  # someone else's socket under that name
            conn.close()
            return None
        socket.send_fds(conn, [spawn_request(command, env, os.getcwd())], [0, 1, 2])
        reader = conn.makefile("rb")
        first = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None
    pid = first.get("pid")
    if not isinstance(pid, int):
        conn.close()
        return None

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, relay)
    while True:
        try:
            line = reader.readline()
            break
        except InterruptedError:
            continue
    try:
        end = json.loads(line) if line else {}
    except ValueError:
        end = {}
    code = end.get("exit")
    if not isinstance(code, int):
        return 1  # the zygote died under it: the child died with it (parent-death signal)
    if code < 0:  # end the way the child did, so that torch sees the signal
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


__all__ = ["ENV_SOCKET", "ENV_SWITCH", "Zygote", "main", "parse_command", "run_through"]

if __name__ == "__main__":
    main(sys.argv[1:])
