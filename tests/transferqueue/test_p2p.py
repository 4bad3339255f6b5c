"""The device path: tensors over a torch.distributed side group (gloo on CPU here, NCCL on GPUs)."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch

from transferqueue import TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue
from transferqueue.p2p import UnitP2P, client_join


def round_trip(servers, device: str) -> None:
    with TQClient(servers.handle, device=device) as client, TQClient(servers.handle) as host_client:
        x = torch.arange(64 * 40, dtype=torch.bfloat16).view(64, 40).to(device)
        responses = [torch.arange(n, dtype=torch.int64, device=device) for n in range(64)]
        meta = client.put({"x": x, "responses": responses}, partition="p", tags=[{"uid": i // 4} for i in range(64)])
        got = client.get(["x", "responses"], 64, "train", "p", sampler="group_complete")
        assert got.meta.sample_ids == meta.sample_ids
        assert got["x"].device.type == torch.device(device).type and torch.equal(got["x"], x)
        assert all(torch.equal(a, b) for a, b in zip(got["responses"], responses, strict=True))
        got["x"].add_(1)  # the caller's own tensor
        # a host client reads the same samples through ZMQ; a p2p client reads host-put data too
        assert torch.equal(host_client.get_data(meta)["x"], x.cpu())
        extra = host_client.put({"y": torch.ones(64, 3)}, partition="p", sample_ids=meta.sample_ids)
        assert torch.equal(client.get_data(extra)["y"].cpu(), torch.ones(64, 3))
        # a rejected p2p put (field already written) leaves the link usable
        with pytest.raises(Exception, match="write-once|already"):
            client.put({"x": x}, partition="p", sample_ids=meta.sample_ids)
        assert torch.equal(client.get_data(meta)["x"], x)


def test_gloo_path_on_cpu():
    cfg = TransferQueueConfig(num_storage_units=2, route_block=16, p2p_backend="gloo", request_timeout_s=30)
    with start_transferqueue(cfg) as servers:
        round_trip(servers, "cpu")


def test_a_units_tcp_rendezvous_store_listens_on_the_units_host_only():
    """A client on another node rendezvouses through the unit's ``TCPStore``: it listens on the unit's host
    (loopback here), never on every interface as c10d's own server does (``common.net.tcp_store``), and the
    link it sets up carries bytes."""
    p2p = UnitP2P("gloo", "cpu", "127.0.0.1", 10.0)
    try:
        reply, join = p2p.connect({"link": "l", "backend": "gloo", "node": "elsewhere"}, "here")
        assert reply["store"] == "tcp" and reply["host"] == "127.0.0.1"
        listening = {c.laddr.ip for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == reply["port"]}
        assert listening == {"127.0.0.1"}
        unit_side = threading.Thread(target=join)
        unit_side.start()
        link = client_join("gloo", reply, "l", 10.0, torch.device("cpu"))
        unit_side.join(10)
        sent = link.send([torch.arange(5, dtype=torch.uint8)])
        assert torch.equal(p2p.receive("l", [5])[0], torch.arange(5, dtype=torch.uint8))
        for work in sent:
            work.wait()
    finally:
        p2p.close()


def test_device_needs_a_p2p_backend(tq_servers):
    with pytest.raises(ValueError, match="p2p_backend"):
        TQClient(tq_servers.handle, device="cpu")


@pytest.mark.gpu
def test_nccl_path_on_gpu():
    cfg = TransferQueueConfig(num_storage_units=1, p2p_backend="nccl", p2p_device="cuda", request_timeout_s=60)
    with start_transferqueue(cfg) as servers:
        round_trip(servers, "cuda:0")
