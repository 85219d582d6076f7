"""Which network interface carries an address: so that gloo and NCCL use the agent's.

gloo binds its sockets to whatever the host name resolves to (127.0.0.1 or
127.0.1.1 on a default Debian install), and NCCL picks an interface by its
own rules; workers on different machines then cannot reach each other. The
agent knows the address other nodes reach it at (``--address``), so the
runner names that address's interface in ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` for the workers, unless the job set them itself.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: get an interface's IPv4 address


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = struct.pack("256s", name[:15].encode())
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None  # no IPv4 address on this interface
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address``, or None.

    A host name is resolved first. Loopback addresses give None: on a single
    machine gloo's default is right.
    """
    try:
        ip = socket.gethostbyname(address)
        if ipaddress.ip_address(ip).is_loopback:
            return None
    except (OSError, ValueError):
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == ip:
            return name
    return None


def socket_interface_env(address: str, env: dict[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for ``address``, minus what ``env`` sets."""
    name = interface_of(address)
    if name is None:
        return {}
    return {k: name for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in env}
