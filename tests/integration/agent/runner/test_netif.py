"""The agent names the interface of its address for gloo and NCCL."""

from __future__ import annotations

import socket
import subprocess

import pytest

from agent.runner.netif import interface_of, socket_interface_env


def _a_non_loopback_ipv4() -> tuple[str, str] | None:
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                             timeout=10).stdout
    except OSError:
        return None
    for line in out.splitlines():
        fields = line.split()
        name, address = fields[1], fields[3].split("/")[0]
        if not address.startswith("127."):
            return name, address
    return None


def test_loopback_and_unknown_addresses_name_no_interface():
    assert interface_of("127.0.0.1") is None
    assert interface_of("localhost") is None
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here
    assert interface_of("no-such-host.invalid") is None
    assert socket_interface_env("127.0.0.1", {}) == {}


def test_the_interface_holding_the_address_is_named_unless_the_job_set_it():
    found = _a_non_loopback_ipv4()
    if found is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    name, address = found
    assert name in {n for _, n in socket.if_nameindex()}
    assert interface_of(address) == name
    assert socket_interface_env(address, {}) == {
        "GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name,
    }
    assert socket_interface_env(address, {"GLOO_SOCKET_IFNAME": "x"}) == {
        "NCCL_SOCKET_IFNAME": name,
    }
