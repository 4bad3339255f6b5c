"""Bounded storage: a full unit makes put wait and then raise Full; nothing accepted is lost."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from transferqueue import Full, TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue

KiB = 1024


@pytest.fixture(scope="module")
def small_tq():
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=1, capacity_bytes=1024 * KiB,
                                                      request_timeout_s=10.0))
    yield servers
    servers.shutdown()


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_full_unit_blocks_then_raises_and_loses_nothing(small_tq, path):
    handle = dataclasses.replace(small_tq.handle, shm_min_bytes=0, shared_memory=path == "shm")
    with TQClient(handle) as client:
        kept = torch.randn(128, 1024)  # 512 KiB
        meta = client.put({"x": kept}, partition=f"a-{path}")
        before = client.status()
        t0 = time.monotonic()
        with pytest.raises(Full):
            client.put({"x": torch.randn(150, 1024)}, partition=f"b-{path}", timeout_s=0.3)
        assert 0.25 <= time.monotonic() - t0 < 5
        after = client.status()
        assert after.num_samples == before.num_samples and after.partitions.get(f"b-{path}", 0) == 0
        assert torch.equal(client.get_data(meta)["x"], kept)  # the accepted put is intact

        # a blocking put succeeds once another worker frees space within its timeout
        freed = threading.Timer(0.3, lambda: TQClient(handle).clear(f"a-{path}"))
        freed.start()
        late = client.put({"x": torch.ones(150, 1024)}, partition=f"c-{path}", timeout_s=5)
        freed.join()
        assert torch.equal(client.get_data(late)["x"], torch.ones(150, 1024))
        client.clear(f"c-{path}")
