"""Client <-> index/storage-unit round trips over real server processes, on both data paths."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import warnings

import pytest
import torch

from transferqueue import Batch, RemoteError, pad_sequences, wire


def part() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


def sample_tensor(dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        with warnings.catch_warnings():  # torch warns that complex32 is experimental
            warnings.simplefilter("ignore", UserWarning)
            return torch.view_as_complex(torch.randn(*shape, 2)).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=torch.int64).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_every_dtype_round_trips(client):
    p = part()
    data = {name: sample_tensor(dtype, (6, 3)) for name, dtype in wire.DTYPES.items()}
    meta = client.put(data, partition=p)
    got = client.get(list(data), 6, "t", p)
    assert got.meta.sample_ids == meta.sample_ids
    for name, t in data.items():
        assert same_bits(got[name], t), name


def test_empty_variable_and_object_fields(client):
    p = part()
    responses = [torch.arange(n, dtype=torch.int32) for n in (0, 3, 1, 7, 2)]
    data = {"empty": torch.zeros(5, 0), "responses": responses, "ground_truth": ["a", "bb", "", "c", {"k": 1}]}
    client.put(data, partition=p, tags=[{"uid": i} for i in range(5)])
    got = client.get(["empty", "responses", "ground_truth"], 5, "t", p)
    assert got["empty"].shape == (5, 0)
    assert isinstance(got["responses"], list) and all(
        torch.equal(a, b) for a, b in zip(got["responses"], responses, strict=True))
    assert got["ground_truth"] == data["ground_truth"]
    assert [t["uid"] for t in got.meta.tags] == list(range(5))
    padded = pad_sequences(got["responses"], 0, "right")
    assert padded.shape == (5, 7) and padded[1].tolist() == [0, 1, 2, 0, 0, 0, 0]


def test_field_goes_from_fixed_to_variable_across_puts(client):
    p = part()
    first = client.put({"x": torch.ones(3, 4)}, partition=p)
    second = client.put({"x": [torch.full((n,), 2.0) for n in (1, 5)]}, partition=p)
    meta = client.get_meta(["x"], 5, "t", p)
    assert meta.schemas["x"].variable
    got = client.get_data(meta)["x"]
    assert meta.sample_ids == first.sample_ids + second.sample_ids
    assert [tuple(t.shape) for t in got] == [(4,), (4,), (4,), (1,), (5,)]


def test_returned_tensors_are_writable_and_independent(client):
    p = part()
    src = torch.arange(4096, dtype=torch.float32).view(8, 512)
    meta = client.put({"x": src.clone()}, partition=p)
    a = client.get_data(meta)["x"]
    a.add_(1)  # writable, no warning-only read-only view
    b = client.get_data(meta)["x"]
    assert torch.equal(b, src) and torch.equal(a, src + 1)


def test_responses_join_prompts_in_the_same_samples(client):
    """The roller flow: prompts put by the feeder, responses into the same ids with version tags."""
    p = part()
    prompts = client.put({"input_ids": torch.arange(8).view(4, 2)}, partition=p, tags=[{"uid": "u"}] * 4)
    group = client.get_meta(["input_ids"], 4, "rollout", p, sampler="group_complete")
    assert group.sample_ids == prompts.sample_ids
    tags = [{"min_weight_version": 0, "max_weight_version": 1, "response_length": n} for n in (1, 2, 3, 4)]
    client.put({"responses": [torch.ones(n, dtype=torch.int64) for n in (1, 2, 3, 4)]}, partition=p,
               sample_ids=group.sample_ids, tags=tags)
    train = client.get_meta(["input_ids", "responses"], 4, "train", p, sampler="group_complete")
    assert train.sample_ids == prompts.sample_ids
    assert train.tags[3] == {"uid": "u", "min_weight_version": 0, "max_weight_version": 1, "response_length": 4}
    info = client.sample_info(p, train.sample_ids[:1])
    assert info[0]["fields"] == ["input_ids", "responses"] and set(info[0]["consumed_by"]) == {"rollout", "train"}
    with pytest.raises(RemoteError, match="write-once"):
        client.put({"responses": torch.zeros(1, 1)}, partition=p, sample_ids=train.sample_ids[:1])


def test_clear_removes_data_everywhere_and_is_idempotent(client, tq_servers):
    p = part()
    meta = client.put({"x": torch.ones(10, 1000)}, partition=p)
    assert client.clear(p, meta.sample_ids[:4]) == 4
    assert client.clear(p, meta.sample_ids[:4]) == 0
    with pytest.raises(RemoteError, match="missing|cleared"):
        client.get_data(meta)
    rest = client.get_meta(["x"], 6, "t", p)
    assert rest.sample_ids == meta.sample_ids[4:]
    assert client.clear(p) == 6 and client.clear(p) == 0
    assert client.get_meta(["x"], 1, "t", p).reason


def test_long_poll_wakes_when_data_arrives(client):
    p = part()
    client.put({"x": torch.zeros(1, 1)}, partition=p)
    assert client.get_meta(["x"], 1, "t", p).sample_ids  # partition exists now

    def later():
        time.sleep(0.3)
        client.put({"x": torch.ones(2, 1)}, partition=p)

    th = threading.Thread(target=later)
    th.start()
    t0 = time.monotonic()
    meta = client.get_meta(["x"], 2, "t", p, timeout_s=10)
    th.join()
    assert len(meta) == 2 and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    empty = client.get_meta(["x"], 2, "t", p, timeout_s=0.3)
    assert len(empty) == 0 and "timed out" in empty.reason and time.monotonic() - t0 >= 0.25


def test_long_poll_does_not_block_other_requests(tq_servers, client):
    p = part()
    client.put({"x": torch.zeros(1, 1)}, partition=p)
    client.get_meta(["x"], 1, "t", p)
    waiter = threading.Thread(target=lambda: client.get_meta(["x"], 1, "t", p, timeout_s=3))
    waiter.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    client.status()  # answered while the other request is parked
    assert time.monotonic() - t0 < 1.0
    client.put({"x": torch.zeros(1, 1)}, partition=p)
    waiter.join(timeout=10)
    assert not waiter.is_alive()


def test_sync_client_inside_a_running_event_loop(client):
    p = part()

    async def main():
        meta = client.put({"x": torch.ones(3, 2)}, partition=p)  # sync call, loop running
        got = client.get(["x"], 3, "t", p)
        ameta = await client.aput({"x": torch.zeros(2, 2)}, partition=p)
        agot = await client.aget(["x"], 2, "t", p)
        return meta, got, ameta, agot

    meta, got, ameta, agot = asyncio.run(main())
    assert got.meta.sample_ids == meta.sample_ids and torch.equal(got["x"], torch.ones(3, 2))
    assert agot.meta.sample_ids == ameta.sample_ids and torch.equal(agot["x"], torch.zeros(2, 2))


def test_async_requests_run_concurrently(client):
    p = part()

    async def main():
        waiter = asyncio.create_task(client.aget_meta(["x"], 4, "t", p, timeout_s=10))
        await asyncio.sleep(0.1)
        await asyncio.gather(*(client.aput({"x": torch.full((1, 3), float(i))}, partition=p) for i in range(4)))
        return await waiter

    assert len(asyncio.run(main())) == 4


def test_batch_chunk_for_workers_and_concat(client):
    p = part()
    client.put({"x": torch.arange(6).view(3, 2), "r": [torch.ones(n) for n in (1, 2, 3)]}, partition=p)
    batch = client.get(["x", "r"], 3, "t", p)
    parts = batch.chunk(4)
    assert [len(b) for b in parts] == [1, 1, 1, 0]
    joined = Batch.concat(parts)
    assert torch.equal(joined["x"], batch["x"]) and [len(t) for t in joined["r"]] == [1, 2, 3]
    assert joined.meta.sample_ids == batch.meta.sample_ids


def test_status_counts(client):
    p = part()
    before = client.status()
    client.put({"x": torch.ones(4, 8)}, partition=p)
    client.get_meta(["x"], 2, "status-task", p)
    st = client.status()
    assert st.produced == before.produced + 4
    assert st.consumed["status-task"] == before.consumed.get("status-task", 0) + 2
    assert st.partitions[p] == 4 and st.ready[p]["status-task|x"] == 2
    assert st.bytes_stored >= before.bytes_stored + 4 * 8 * 4
    assert st.requests["get_meta"][0] >= 1
    assert client.unit_stats(0)["requests"]


def test_large_gets_never_share_memory_while_alive(client):
    """Output buffers are recycled only after every tensor viewing them is gone."""
    p = part()
    src = torch.arange(512 * 1024, dtype=torch.float64).view(64, 8192)  # 4 MiB: pooled mapping path
    meta = client.put({"x": src}, partition=p)
    a = client.get_data(meta)["x"]
    b = client.get_data(meta)["x"]
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.fill_(-1)
    del a
    c = client.get_data(meta)["x"]  # may reuse a's pages
    c.fill_(-2)
    assert torch.equal(b, src) and torch.equal(client.get_data(meta)["x"], src)


def test_client_side_loads_no_server_module():
    """The shared-memory layout lives in ``shm_layout``: importing the client, its buffers and its p2p path
    loads neither the storage unit nor the server loop (the old ``storage → p2p → buffers → storage`` cycle)."""
    import subprocess
    import sys

    code = ("import sys, transferqueue.client, transferqueue.buffers, transferqueue.p2p; "
            "print(sorted(m for m in ('transferqueue.storage', 'transferqueue.server', 'transferqueue.index') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
