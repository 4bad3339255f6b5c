"""Failure clean-up and shutdown: a rejected put leaves nothing behind; servers exit and free memory."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import threading
import time

import pytest
import torch

from transferqueue import Closed, RemoteError, TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_put_rejected_by_the_index_is_undone_on_the_units(tq_servers, path):
    handle = dataclasses.replace(tq_servers.handle, shm_min_bytes=0, shared_memory=path == "shm")
    with TQClient(handle) as client:
        p = f"undo-{path}"
        client.put({"x": torch.zeros(8, 4, dtype=torch.int64)}, partition=p)
        before = [client.unit_stats(u)["stored_bytes"] for u in range(2)]
        with pytest.raises(RemoteError, match="dtype"):  # detected by the index after the units stored it
            client.put({"x": torch.zeros(8, 4, dtype=torch.float32)}, partition=p)
        assert [client.unit_stats(u)["stored_bytes"] for u in range(2)] == before
        assert client.status().partitions[p] == 8
        client.clear(p)


def test_shutdown_stops_servers_and_unlinks_shared_memory():
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=2, request_timeout_s=10))
    client = TQClient(dataclasses.replace(servers.handle, shm_min_bytes=0))
    client.put({"x": torch.ones(256, 1024)}, partition="p")
    pids = [p.pid for p in servers.procs]
    assert any(glob.glob(f"/dev/shm/hflow-tq-{pid}-*") for pid in pids)
    client.close()
    with pytest.raises(Closed):
        client.status()
    servers.shutdown()
    servers.shutdown()  # idempotent
    assert [p.returncode for p in servers.procs] == [0, 0, 0]
    assert not any(glob.glob(f"/dev/shm/hflow-tq-{pid}-*") for pid in pids)


def test_custom_sampler_module_is_loaded_by_the_index_process():
    cfg = TransferQueueConfig(num_storage_units=1, sampler_modules=["tests.transferqueue.sampler_plugin"])
    with start_transferqueue(cfg) as servers, TQClient(servers.handle) as client:
        meta = client.put({"x": torch.arange(5).view(5, 1)}, partition="p")
        got = client.get_meta(["x"], 2, "t", "p", sampler="newest_first")
        assert got.sample_ids == meta.sample_ids[::-1][:2]
        with pytest.raises(RemoteError, match="unknown sampler"):
            client.get_meta(["x"], 2, "t", "p", sampler="not-registered")


def test_close_during_a_waiting_request_raises_closed_in_both_apis(tq_servers):
    """``close`` from elsewhere while a long-poll waits: the caller gets ``Closed`` — not the ZMQ error of
    its destroyed socket (sync), nor a ``CancelledError`` it never asked for (async)."""
    got = []
    sync_client = TQClient(tq_servers.handle)

    def wait() -> None:
        try:
            sync_client.get_meta(["x"], 1, "t", "close-sync", timeout_s=5)
        except Exception as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    sync_client.close()
    waiter.join(timeout=10)

    async def main(client: TQClient) -> BaseException | None:
        task = asyncio.create_task(client.aget_meta(["x"], 1, "t", "close-async", timeout_s=5))
        await asyncio.sleep(0.5)
        client.close()
        try:
            await task
        except BaseException as exc:  # noqa: BLE001 - CancelledError is what must not come out
            return exc
        return None

    got.append(asyncio.run(main(TQClient(tq_servers.handle))))
    assert [type(e) for e in got] == [Closed, Closed]
