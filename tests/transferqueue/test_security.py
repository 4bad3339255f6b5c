"""CURVE: a peer without the job's keys is refused; one with them is served."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.curve import make_job_keys
from transferqueue import Timeout, TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue


@pytest.fixture(scope="module")
def curve_tq():
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=1, curve=True, request_timeout_s=10.0))
    yield servers
    servers.shutdown()


def test_keyed_peer_is_served(curve_tq):
    assert curve_tq.handle.curve is not None
    with TQClient(dataclasses.replace(curve_tq.handle, shared_memory=False)) as client:
        meta = client.put({"x": torch.arange(4).view(2, 2)}, partition="p")
        assert torch.equal(client.get_data(meta)["x"], torch.arange(4).view(2, 2))


@pytest.mark.parametrize("who", ["no keys", "wrong client key"])
def test_peer_without_the_key_is_refused(curve_tq, who):
    other = make_job_keys()
    curve = None if who == "no keys" else dataclasses.replace(
        curve_tq.handle.curve, client_public=other.client_public, client_secret=other.client_secret)
    handle = dataclasses.replace(curve_tq.handle, curve=curve, request_timeout_s=0.5)
    with TQClient(handle) as intruder, pytest.raises(Timeout):
        intruder.status()
