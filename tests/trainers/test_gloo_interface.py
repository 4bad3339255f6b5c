"""A gloo group (the trainers', the checkpoint engine's ``broadcast`` group) binds the interface on the
rendezvous address's network (``common.net.gloo_interface``), unless the user set ``GLOO_SOCKET_IFNAME``. The real group on ``lo``: test_group.py's
two ranks (Ray actors) and every test that calls ``init_distributed``."""

from __future__ import annotations

import logging
import os
import socket
from types import SimpleNamespace

import psutil
import pytest

from common import net
from common.net import GLOO_IFNAME_ENV, gloo_interface, gloo_interface_name

TABLE = {"lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1", netmask="255.0.0.0")],
         "eth0": [SimpleNamespace(family=socket.AF_INET, address="10.2.0.7", netmask="255.255.255.0")]}


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: TABLE)
    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)


def test_interface_set_while_the_group_is_made_then_restored(table, caplog):
    with caplog.at_level(logging.INFO, logger=net.__name__), gloo_interface("127.0.0.1", "trainer rank 1"):
        assert os.environ[GLOO_IFNAME_ENV] == "lo"
    assert GLOO_IFNAME_ENV not in os.environ
    assert "trainer rank 1: gloo uses interface lo for the group at 127.0.0.1" in caplog.text


def test_a_user_setting_is_left_alone_and_logged(table, monkeypatch, caplog):
    monkeypatch.setenv(GLOO_IFNAME_ENV, "eth9")
    with caplog.at_level(logging.INFO, logger=net.__name__), gloo_interface("127.0.0.1", "trainer rank 0"):
        assert os.environ[GLOO_IFNAME_ENV] == "eth9"
    assert os.environ[GLOO_IFNAME_ENV] == "eth9"
    assert "GLOO_SOCKET_IFNAME=eth9 is set, gloo uses it" in caplog.text


def test_a_rank_off_rank_0s_network_uses_its_ray_node_address(table, monkeypatch):
    monkeypatch.setattr(net, "node_ip_address", lambda: "10.2.0.7")
    assert gloo_interface_name("10.2.0.99") == "eth0"  # rank 0 on this rank's network
    assert gloo_interface_name("10.9.0.1") == "eth0"  # elsewhere: this rank's Ray node address
    monkeypatch.setattr(net, "node_ip_address", lambda: "10.8.0.3")
    with pytest.raises(ValueError, match=r"rendezvous at 10\.9\.0\.1: .*Ray node address.*of 10\.8\.0\.3"):
        gloo_interface_name("10.9.0.1")


def test_outside_ray_an_unknown_network_is_an_error_naming_the_address(table, monkeypatch):
    def not_in_ray():
        raise RuntimeError("this process is not in a Ray cluster")

    monkeypatch.setattr(net, "node_ip_address", not_in_ray)  # whether or not the session's Ray is up
    with pytest.raises(ValueError, match=r"rendezvous at 10\.9\.0\.1: no network interface .* of 10\.9\.0\.1"):
        with gloo_interface("10.9.0.1", "trainer rank 0"):
            pass
    assert GLOO_IFNAME_ENV not in os.environ


def test_the_weight_broadcast_group_binds_the_interface_of_its_rendezvous(table, monkeypatch):
    """The checkpoint engine's ``broadcast`` group is a gloo group too: created with the interface on its
    rendezvous address's network set (a one-node job's on ``lo``, whatever the host name resolves to)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from checkpointengine import broadcast

    seen = []

    def helper(world_size, rank, ranks, backend, store, **kwargs):
        seen.append((str(backend), os.environ.get(GLOO_IFNAME_ENV)))
        return object(), None

    monkeypatch.setattr(c10d, "_new_process_group_helper", helper)
    groups = [broadcast._new_group(dist.HashStore(), 0, 2, "g-sender", "gloo", 5.0, "127.0.0.1", "weight sender"),
              broadcast._new_group(dist.HashStore(), 1, 2, "g-roller", "gloo", 5.0, "10.2.0.1",
                                   "weight receiver rank 1")]
    for group in groups:  # the stand-ins leave torch's table of groups as it was
        del c10d._world.pg_group_ranks[group]
    assert seen == [("gloo", "lo"), ("gloo", "eth0")]
    assert GLOO_IFNAME_ENV not in os.environ
