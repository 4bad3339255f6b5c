"""``common.net.interface_of``: the interface on an address's network, looked up in ``psutil.net_if_addrs``
(the real table for loopback, a made-up one for the choice rules and the errors)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import psutil
import pytest

from common.net import interface_of


def _addr(address: str, netmask: str) -> SimpleNamespace:
    return SimpleNamespace(family=socket.AF_INET, address=address, netmask=netmask)


FAKE_TABLE = {
    "lo": [_addr("127.0.0.1", "255.0.0.0")],
    "eth0": [_addr("10.1.2.3", "255.255.0.0"), SimpleNamespace(family=socket.AF_INET6, address="fd00::2",
                                                                netmask="ffff:ffff:ffff:ffff::")],
    "eth1": [_addr("10.1.9.4", "255.255.255.0")],
    "docker0": [_addr("172.17.0.1", "255.255.0.0")],
    "ifb0": [SimpleNamespace(family=socket.AF_PACKET, address="42:43:d2:d4:ec:8b", netmask=None)],
}


def test_loopback_addresses_map_to_the_interface_holding_127_0_0_1():
    (loopback,) = [name for name, addrs in psutil.net_if_addrs().items()
                   if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)]
    assert interface_of("127.0.0.1") == loopback
    assert interface_of("127.0.0.2") == loopback  # not listed itself: lo holds 127.0.0.1/8


def test_exact_address_then_most_specific_network(monkeypatch):
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: FAKE_TABLE)
    assert interface_of("10.1.2.3") == "eth0"  # held exactly
    assert interface_of("10.1.9.4") == "eth1"  # held exactly, though eth0's /16 holds it too
    assert interface_of("10.1.9.77") == "eth1"  # a peer: eth1's /24 beats eth0's /16
    assert interface_of("10.1.200.5") == "eth0"
    assert interface_of("127.5.5.5") == "lo"
    assert interface_of("172.17.3.3") == "docker0"


def test_no_interface_on_the_network_is_an_error_naming_the_address(monkeypatch):
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: FAKE_TABLE)
    with pytest.raises(ValueError, match=r"of 192\.168\.7\.7: the interfaces hold .*eth1 10\.1\.9\.4/24"):
        interface_of("192.168.7.7")
    for bad in ("node", "fd00::2", "10.1.2.3:80", ""):
        with pytest.raises(ValueError, match="by IPv4 address, got"):
            interface_of(bad)
