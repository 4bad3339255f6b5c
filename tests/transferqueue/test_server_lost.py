"""A TransferQueue server process that dies is a clear error, never a wait until the request timeout: the
launcher names it and how it ended (``TQServers.check``); a client waiting on it (or about to) gets
``ServerLost`` naming it once its connection stayed down ``transport.LOST_AFTER_S``; its shared memory goes
at shutdown. Real server processes, killed with SIGKILL."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import pickle
import time

import pytest
import torch

from transferqueue import ServerLost, TQClient, transport
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue

REQUEST_TIMEOUT_S = 60.0  # what a client would wait without the connection check
LOST_AFTER_S = 1.0  # shortened for the test (the default is a few seconds)


def test_dead_storage_unit_and_index_are_named_long_before_the_request_timeout(monkeypatch):
    monkeypatch.setattr(transport, "LOST_AFTER_S", LOST_AFTER_S)
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=2, route_block=4,
                                                      request_timeout_s=REQUEST_TIMEOUT_S))
    pids = [p.pid for p in servers.procs]
    client = TQClient(dataclasses.replace(servers.handle, shm_min_bytes=0))
    try:
        meta = client.put({"x": torch.ones(8, 256)}, partition="p")  # route_block 4: samples on both units
        assert glob.glob(f"/dev/shm/hflow-tq-{pids[2]}-*")
        servers.check()  # all alive: nothing raised
        unit1 = servers.procs[2]
        unit1.kill()
        unit1.wait(timeout=10)
        with pytest.raises(ServerLost, match=rf"TransferQueue storage unit 1 \(pid {pids[2]}, tcp://.*\) died: "
                                             "killed by SIGKILL") as lost:
            servers.check()
        assert lost.value.server == "storage unit 1"

        started = time.monotonic()
        with pytest.raises(ServerLost, match="storage unit 1 at .* is gone") as lost:
            client.get_data(meta)  # its connection to unit 1 was open, and closed with the process
        assert lost.value.server == "storage unit 1"
        again = pickle.loads(pickle.dumps(lost.value))  # as Ray carries it from a worker to its caller
        assert (again.server, str(again)) == (lost.value.server, str(lost.value))

        async def fresh_get():  # a client that never reached unit 1: nothing ever answers its connect
            with TQClient(servers.handle) as fresh:
                await fresh.aget_data(meta)

        with pytest.raises(ServerLost, match="storage unit 1"):
            asyncio.run(fresh_get())
        assert time.monotonic() - started < 4 * (LOST_AFTER_S + transport.WAIT_SLICE_S) + 2.0 < REQUEST_TIMEOUT_S
        assert client.status().partitions["p"] == 8  # the index and its other clients go on

        async def index_dies_during_a_long_poll():
            task = asyncio.create_task(client.aget_meta(["x"], 100, "t", "p", timeout_s=30.0))
            await asyncio.sleep(0.3)
            servers.procs[0].kill()
            return await task

        started = time.monotonic()
        with pytest.raises(ServerLost, match="TransferQueue index at .* is gone: .*; get_meta not answered"):
            asyncio.run(index_dies_during_a_long_poll())
        assert time.monotonic() - started < 2 * (LOST_AFTER_S + transport.WAIT_SLICE_S) + 2.0
    finally:
        client.close()
        servers.shutdown()
    assert [p.returncode for p in servers.procs] == [-9, 0, -9]
    assert not any(glob.glob(f"/dev/shm/hflow-tq-{pid}-*") for pid in pids)  # the killed unit's blocks too
