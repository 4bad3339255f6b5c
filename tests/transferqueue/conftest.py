"""TransferQueue test fixtures: real server subprocesses, started once per module that asks for them."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from transferqueue.client import TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue


@pytest.fixture(scope="session")
def tq_servers():
    """An index and two storage units (route_block 4 so small batches span both units)."""
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=2, capacity_bytes=256 * 1024**2,
                                                      route_block=4, request_timeout_s=20.0))
    yield servers
    servers.shutdown()


@pytest.fixture(params=["shm", "zmq"])
def client(request, tq_servers):
    """A client on the shared-memory path (every put large enough) or on raw ZMQ frames only."""
    if request.param == "shm":
        handle = dataclasses.replace(tq_servers.handle, shm_min_bytes=0)
    else:
        handle = dataclasses.replace(tq_servers.handle, shared_memory=False)
    c = TQClient(handle)
    yield c
    c.close()


@pytest.fixture
def shm_client(tq_servers):
    c = TQClient(dataclasses.replace(tq_servers.handle, shm_min_bytes=0))
    yield c
    c.close()


@pytest.fixture
def rejecting_unit(monkeypatch):
    """``with rejecting_unit(u):`` storage unit ``u`` rejects this process's shared-memory puts (their
    offsets point past any block), so a put fails on that unit alone."""

    @contextlib.contextmanager
    def reject(unit: int):
        write_block = TQClient._write_block

        def bad_offsets(self, target, *args):
            call = write_block(self, target, *args)
            if target == unit:
                call.header["shm"]["offsets"] = [1 << 40]
            return call

        with monkeypatch.context() as m:
            m.setattr(TQClient, "_write_block", bad_offsets)
            yield

    return reject
