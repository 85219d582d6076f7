"""Several "machines" on one Linux host: network namespaces on a private bridge.

A :class:`Network` is a bridge in a network namespace of its own and one
namespace per :class:`Host`, joined to the bridge by a veth pair, each host with
its own address on a private /24. Nothing is created in the root namespace: no
interface, address or route, so the test network can neither clash with nor
reach anything else on the machine; every namespace and link is named with a
prefix unique to this process (``tdlnet<pid>n<k>-``).

What a test can do with it:

* start processes on a host (``ip netns exec NS ARGV...``, an argument list,
  never a shell; each in its own process group through
  :class:`~tests.support.processes.ProcessGroupRegistry`);
* cut a host off (:meth:`Network.cut`: its bridge-side veth goes down, so
  packets vanish silently as behind a dead switch port, nothing is refused)
  and :meth:`Network.heal` it;
* degrade a host's link (:meth:`Network.degrade`: ``tc netem`` delay and loss,
  where the kernel has netem);
* kill a host (:meth:`Network.kill_host`: SIGKILL every process in its
  namespace, as a machine losing power);
* run Python code inside a host's namespace from the test process
  (:class:`NamespaceThread`: a thread that ``setns()``-ed into it; sockets
  created on that thread belong to the namespace), e.g. an HTTP client.

:meth:`Network.destroy` kills every process in every namespace and deletes the
namespaces (deleting the bridge namespace deletes the veth pairs with it);
:func:`sweep` removes what a crashed run of this process, or of a process that
no longer exists, left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tests.support.processes import ProcessGroupRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Every namespace this harness creates is called ``tdlnet<pid>n<k>-<name>``.
PREFIX_ROOT = "tdlnet"
_NAME_RE = re.compile(rf"^{PREFIX_ROOT}(\d+)n\d+-")
_NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_BRIDGE = "br0"
_counter = itertools.count()


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (never through a shell)."""
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def unavailable_reason() -> str | None:
    """Why network-namespace tests cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add, veth pairs)"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2's `ip` on PATH"
    probe = f"{PREFIX_ROOT}{os.getpid()}n{next(_counter)}-probe"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1",
                   check=False)
        bridge = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    if veth.returncode != 0:
        return f"cannot create a veth pair: {veth.stderr.strip()}"
    if bridge.returncode != 0:
        return f"cannot create a bridge: {bridge.stderr.strip()}"
    return None


@functools.cache
def netem_unavailable_reason() -> str | None:
    """Why ``tc ... netem`` cannot be used here (no tc, or a kernel without sch_netem)."""
    if shutil.which("tc") is None:
        return "tc (iproute2) is not on PATH"
    probe = f"{PREFIX_ROOT}{os.getpid()}n{next(_counter)}-netem"
    _ip("netns", "add", probe)
    try:
        result = subprocess.run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", "1ms"],
            capture_output=True, text=True, timeout=20, check=False,
        )
    finally:
        _ip("netns", "del", probe, check=False)
    if result.returncode != 0:
        return f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): {result.stderr.strip()}"
    return None


def _bpf_loss_commands(dev: str, loss_pct: float) -> list[list[str]]:
    """tc commands that drop ``loss_pct`` percent of ``dev``'s outgoing packets, without netem.

    Classic BPF (``cls_bpf``): ``A = random u32; if A >= threshold: no match;
    else: match`` -- a match goes to class 1:2, whose pfifo has room for nothing.
    """
    threshold = int(min(max(loss_pct, 0.0), 100.0) / 100 * 0xFFFFFFFF)
    # ld [SKF_AD_OFF + SKF_AD_RANDOM]; jge #threshold, 1, 0; ret #-1; ret #0
    program = f"4,32 0 0 {0xFFFFF038},53 1 0 {threshold},6 0 0 {0xFFFFFFFF},6 0 0 0,"
    return [
        ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1",
         "r2q", "100000"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit"],
        ["qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0"],
        ["filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1",
         "bpf", "bytecode", program, "classid", "1:2"],
    ]


def namespace_pids(netns: str) -> list[int]:
    """PIDs of the processes living in network namespace ``netns``."""
    result = _ip("netns", "pids", netns, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def kill_namespace_processes(netns: str, *, timeout: float = 10.0) -> int:
    """SIGKILL every process in ``netns`` until none is left; returns how many were killed.

    Raises:
        TimeoutError: processes were still there after ``timeout`` seconds.
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = [pid for pid in namespace_pids(netns) if pid != os.getpid()]
        if not pids:
            return len(killed)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} in namespace {netns} survived SIGKILL")
        time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(*, include_own: bool = True) -> list[str]:
    """Delete namespaces named by this harness whose creator is gone (or is this process).

    Their processes are SIGKILLed first. Namespaces of another live process
    running this harness are never touched.

    Args:
        include_own: also delete this process's own namespaces (at the end of
            a session); False leaves those of a network still in use alone.

    Returns:
        The names of the namespaces deleted.
    """
    if not _NETNS_DIR.is_dir():
        return []
    removed = []
    for entry in sorted(_NETNS_DIR.iterdir()):
        match = _NAME_RE.match(entry.name)
        if not match:
            continue
        owner = int(match.group(1))
        if owner == os.getpid() and not include_own:
            continue
        if owner != os.getpid() and _pid_alive(owner):
            continue
        with contextlib.suppress(TimeoutError):
            kill_namespace_processes(entry.name)
        if _ip("netns", "del", entry.name, check=False).returncode == 0:
            removed.append(entry.name)
    return removed


def _enter_namespace(netns: str) -> None:
    """Move the calling thread (only it) into network namespace ``netns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(_NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NamespaceThread:
    """One thread living in a host's network namespace; runs callables there.

    A socket belongs to the network namespace of the thread that created it,
    so an HTTP client created and used through :meth:`call` talks from inside
    the host, while the rest of the test process stays in the root namespace.

    Args:
        netns: the namespace's name (``ip netns list``).
    """

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"netns-{netns}",
            initializer=_enter_namespace, initargs=(netns,),
        )
        self.local = threading.local()  # per-thread state for the callables (a client)

    def call(self, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
        """Run ``fn()`` on the namespace's thread and return its result (or raise its error)."""
        return self._executor.submit(fn).result(timeout=timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Host:
    """One "machine": a network namespace with one interface (``eth0``) on the bridge."""

    name: str
    netns: str
    ip: str
    #: The bridge side of the host's veth pair (in the bridge's namespace).
    port: str


class Network:
    """A private bridge and the hosts on it. Call :meth:`destroy` when done (a fixture does).

    Args:
        procs: the test's process registry (every process started goes through it).
        subnet: the hosts' /24; by default ``10.77.X.0/24`` with an X that no
            route of the root namespace covers (the network is isolated in
            its own namespaces anyway).
    """

    def __init__(self, procs: ProcessGroupRegistry, *, subnet: str | None = None) -> None:
        self.procs = procs
        self.prefix = f"{PREFIX_ROOT}{os.getpid()}n{next(_counter)}-"
        self.subnet = ipaddress.ip_network(subnet or _unused_subnet())
        self.bridge_ns = f"{self.prefix}br"
        self.hosts: dict[str, Host] = {}
        self._threads: dict[str, NamespaceThread] = {}
        self._created: list[str] = []
        self._degraded: set[str] = set()
        self._spawned: dict[str, list[subprocess.Popen[bytes]]] = {}
        try:
            _ip("netns", "add", self.bridge_ns)
            self._created.append(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", _BRIDGE, "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", _BRIDGE, "up")
        except BaseException:
            self.destroy()
            raise

    def add_host(self, name: str, *, index: int) -> Host:
        """Create host ``name`` with address ``<subnet>.<index>`` on the bridge.

        Raises:
            ValueError: the name or index is taken, or the index is not in 2..254.
        """
        if name in self.hosts or not re.fullmatch(r"[a-z0-9]{1,8}", name):
            raise ValueError(f"host name {name!r} is taken or not 1-8 of [a-z0-9]")
        if not 2 <= index <= 254 or any(h.ip.endswith(f".{index}") for h in self.hosts.values()):
            raise ValueError(f"host index {index} is taken or not in 2..254")
        netns = f"{self.prefix}{name}"
        ip = str(self.subnet.network_address + index)
        port = f"v-{name}"
        _ip("netns", "add", netns)
        self._created.append(netns)
        # Both ends are created in the bridge's namespace and one is moved
        # straight into the host's: no interface ever appears in the root namespace.
        _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth",
            "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.bridge_ns, "link", "set", port, "master", _BRIDGE, "up")
        _ip("-n", netns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        host = Host(name=name, netns=netns, ip=ip, port=port)
        self.hosts[name] = host
        return host

    # processes ------------------------------------------------------------------

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host``, in a process group of its own, output to ``log_path``."""
        proc = self.procs.spawn(
            ["ip", "netns", "exec", host.netns, *argv], log_path=log_path, env=env, cwd=cwd
        )
        self._spawned.setdefault(host.name, []).append(proc)
        return proc

    def run(
        self, host: Host, argv: Sequence[str], *, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion; output captured."""
        return subprocess.run(
            ["ip", "netns", "exec", host.netns, *argv],
            capture_output=True, text=True, timeout=timeout, check=False,
        )

    def thread(self, host: Host) -> NamespaceThread:
        """The test's thread inside ``host`` (created on first use)."""
        if host.name not in self._threads:
            self._threads[host.name] = NamespaceThread(host.netns)
        return self._threads[host.name]

    def pids(self, host: Host) -> list[int]:
        return namespace_pids(host.netns)

    # faults ---------------------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Cut ``host`` off: its switch port goes down; its packets vanish silently.

        Every process on it keeps running; connections are not reset, they
        stall until a timeout of their own, as behind a real partition.
        """
        _ip("-n", self.bridge_ns, "link", "set", host.port, "down")
        log.info("cut off %s (%s)", host.name, host.ip)

    def heal(self, host: Host) -> None:
        """Undo :meth:`cut` and :meth:`degrade` for ``host``."""
        _ip("-n", self.bridge_ns, "link", "set", host.port, "up")
        if host.name in self._degraded:
            for netns, dev in ((host.netns, "eth0"), (self.bridge_ns, host.port)):
                subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True, timeout=20, check=False)
            self._degraded.discard(host.name)
        log.info("healed %s (%s)", host.name, host.ip)

    def degrade(self, host: Host, *, delay_ms: int = 200, loss_pct: float = 10.0) -> str:
        """Add latency and loss to ``host``'s link, both ways; :meth:`heal` removes them.

        With netem (``tc qdisc ... netem delay D loss L%`` on both ends of the
        veth pair). Where the kernel has no netem, loss alone is emulated with
        what it has: an HTB root whose filter, a classic BPF program on
        ``ld rand``, sends that share of the packets to a class whose FIFO
        holds nothing.

        Returns:
            ``"netem"`` or ``"bpf-loss"``: how the link was degraded.

        Raises:
            RuntimeError: delay asked for without netem, or tc failed.
        """
        netem = netem_unavailable_reason() is None
        if not netem and delay_ms:
            raise RuntimeError(f"delay needs netem: {netem_unavailable_reason()}")
        for netns, dev in ((host.netns, "eth0"), (self.bridge_ns, host.port)):
            if netem:
                commands = [["qdisc", "replace", "dev", dev, "root", "netem",
                             "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]]
            else:
                commands = _bpf_loss_commands(dev, loss_pct)
            for command in commands:
                result = subprocess.run(["ip", "netns", "exec", netns, "tc", *command],
                                        capture_output=True, text=True, timeout=20, check=False)
                if result.returncode != 0:
                    raise RuntimeError(f"tc {' '.join(command)} in {netns} failed: "
                                       f"{result.stderr.strip()}")
        self._degraded.add(host.name)
        log.info("degraded %s: %s", host.name,
                 f"netem {delay_ms} ms, {loss_pct}% loss" if netem else f"{loss_pct}% loss")
        return "netem" if netem else "bpf-loss"

    def kill_host(self, host: Host) -> int:
        """SIGKILL every process on ``host`` (a machine losing power); returns how many.

        The processes this network started there are reaped; the link stays up.
        """
        killed = kill_namespace_processes(host.netns)
        for proc in self._spawned.pop(host.name, []):  # reap them: no zombie left
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        log.info("killed host %s: %d process(es)", host.name, killed)
        return killed

    # teardown -------------------------------------------------------------------

    def destroy(self) -> None:
        """Kill every process in the network and delete every namespace it created."""
        for thread in self._threads.values():
            thread.close()
        self._threads.clear()
        for netns in reversed(self._created):
            try:
                kill_namespace_processes(netns)
            except TimeoutError as exc:
                log.error("%s", exc)
            result = _ip("netns", "del", netns, check=False)
            if result.returncode != 0:
                log.error("could not delete namespace %s: %s", netns, result.stderr.strip())
        self._created.clear()
        self.hosts.clear()


def _unused_subnet() -> str:
    """``10.77.X.0/24`` with an X no root-namespace route or address covers."""
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    addrs = _ip("-4", "-o", "addr", "show", check=False).stdout
    used = [ipaddress.ip_network(m, strict=False)
            for m in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", routes + addrs)]
    start = os.getpid() % 200
    for offset in range(250):
        third = (start + offset) % 250 + 1
        candidate = ipaddress.ip_network(f"10.77.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return str(candidate)
    raise RuntimeError("every 10.77.X.0/24 is in use in the root namespace")
