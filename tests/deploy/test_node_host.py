"""``node`` as a bind address (``transferqueue.host``, ``checkpointengine.host``, ``trainer.host``): the Ray
node address of the process that opens the socket, which binds exactly that address and reports it to its
peers; the config takes one IPv4 address or ``node`` and names the key for anything else.

127.0.0.2 stands in for a node address other than the default (still loopback, so nothing leaves the
machine): ``common.net.node_ip_address`` is patched to return it in this process. The real resolution runs
in a Ray worker of the session's cluster, and the whole path across two Ray nodes in test_two_nodes.py
(marker ``cluster``). That a one-node job with the defaults listens on loopback only is
tests/controller/test_security.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from checkpointengine import WeightSender
from checkpointengine.config import CheckpointEngineConfig
from common import net
from common.net import check_bind_host, resolve_bind_host
from tests.checkpointengine.test_cross_node import _listens_on, _send_one
from trainers.group import rendezvous_host
from trainers.worker import TrainerActor
from transferqueue import TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue

NODE_ADDRESS = "127.0.0.2"


@pytest.fixture
def node_address(monkeypatch) -> str:
    monkeypatch.setattr(net, "node_ip_address", lambda: NODE_ADDRESS)
    return NODE_ADDRESS


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.5", "node"])
def test_a_bind_host_is_one_ipv4_address_or_node(host):
    check_bind_host("transferqueue.host", host)


@pytest.mark.parametrize("host", ["", "localhost", "nodes", "NODE", "0.0.0.0", "224.0.0.1", "255.255.255.255",
                                  "::1", "10.0.0.5:1", 5])
def test_any_other_bind_host_is_refused_naming_the_key(host):
    with pytest.raises(ValueError, match=rf"trainer\.host must be one IPv4 address .*'node'.*{re.escape(repr(host))}"):
        check_bind_host("trainer.host", host)


def test_node_outside_a_ray_cluster_is_an_error_naming_the_key(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert resolve_bind_host("trainer.host", "10.0.0.5") == "10.0.0.5"  # an address is itself, Ray or not
    with pytest.raises(RuntimeError, match=r"trainer\.host='node' binds the Ray node address .*not in a Ray cluster"):
        resolve_bind_host("trainer.host", "node")


def test_a_node_address_that_is_not_ipv4_names_the_key(monkeypatch):
    monkeypatch.setattr(net, "node_ip_address", lambda: "fd00::5")
    with pytest.raises(ValueError, match=r"checkpointengine\.host='node': .*'fd00::5' is not an IPv4 address"):
        resolve_bind_host("checkpointengine.host", "node")


def test_node_is_the_ray_node_address_of_the_process_that_binds(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def in_a_worker() -> tuple[str, str]:
        import ray

        from common.net import resolve_bind_host

        return resolve_bind_host("trainer.host", "node"), ray.get_runtime_context().get_node_id()

    address, node = ray.get(in_a_worker.remote(), timeout=120)
    assert address == {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}[node]
    assert resolve_bind_host("transferqueue.host", "node") == ray.util.get_node_ip_address()  # the driver's


def test_transferqueue_servers_bind_and_report_the_launchers_node_address(node_address):
    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=1 << 20, host="node", request_timeout_s=10.0)
    with start_transferqueue(cfg) as servers:
        handle = servers.handle
        endpoints = [handle.index_address, *handle.unit_addresses]
        assert all(e.startswith(f"tcp://{node_address}:") for e in endpoints), endpoints
        for endpoint in endpoints:  # listening on that one address, nowhere else
            port = int(endpoint.rsplit(":", 1)[1])
            assert _listens_on(port) == [f"{node_address}:{port}"]
        remote = dataclasses.replace(handle, index_node="elsewhere", unit_nodes=["elsewhere"])
        with TQClient(remote) as client:  # a client on another node connects to the reported endpoints
            data = torch.arange(12.0).view(3, 4)
            client.put({"x": data}, partition="p")
            assert torch.equal(client.get("x", 3, "t", "p")["x"], data)


def test_the_weight_plane_leader_binds_and_reports_its_node_address(node_address):
    cfg = CheckpointEngineConfig(backend="zmq", bucket_bytes=1024, timeout_s=10.0, host="node")
    sender = WeightSender(cfg, ["r0"])
    try:
        assert sender.handle.control_address.startswith(f"tcp://{node_address}:")
        port = int(sender.handle.control_address.rsplit(":", 1)[1])
        assert _listens_on(port) == [f"{node_address}:{port}"]
        _send_one(sender, sender.handle, "r0", 1)  # a roller given the handle connects there and gets weights
    finally:
        sender.close()


def test_trainer_rank_0_reports_a_rendezvous_on_its_node_address(node_address):
    """Rank 0's ``rendezvous_address`` across nodes, and the store the ranks then meet at there."""
    rank_0 = TrainerActor.__new__(TrainerActor)  # the method alone: no torch threads set in this process
    address, port = rank_0.rendezvous_address(rendezvous_host("node", ["node-a", "node-b"]))
    assert address == node_address and port > 0
    store = net.tcp_store(address, port, 2, True, timeout_s=10, wait_for_workers=False)
    assert _listens_on(port) == [f"{node_address}:{port}"]
    peer = net.tcp_store(address, port, 2, False, timeout_s=10)
    peer.set("k", "v")
    assert store.get("k") == b"v"


def test_trainer_ranks_meet_on_loopback_on_one_node_and_on_trainer_host_across_nodes():
    assert rendezvous_host("node", ["n1", "n1", "n1"]) == "127.0.0.1"
    assert rendezvous_host("10.0.0.5", ["n1"]) == "127.0.0.1"
    assert rendezvous_host("node", ["n1", "n2"]) == "node"  # resolved by rank 0 itself
    assert rendezvous_host("10.0.0.5", ["n1", "n1", "n2"]) == "10.0.0.5"
    for loopback in ("127.0.0.1", "127.0.0.2"):
        with pytest.raises(ValueError, match=rf"placed on 2 Ray nodes, but trainer\.host='{loopback}' is a loopback"):
            rendezvous_host(loopback, ["n1", "n2", "n1"])


def test_shm_weights_refuse_a_trainer_rank_on_another_node_than_rank_0():
    cfg = CheckpointEngineConfig(backend="shm", bucket_bytes=1024, timeout_s=10.0)
    leader = WeightSender(cfg, ["r0"])
    try:
        fields = dataclasses.replace(leader.handle.fields, node="ray:elsewhere")
        with pytest.raises(ValueError, match=r"this rank is on node .*: use checkpointengine\.backend=zmq .*span nodes"):
            WeightSender(cfg, rank=1, handle=dataclasses.replace(leader.handle_for_ranks(), fields=fields))
    finally:
        leader.close()
