"""The latency fast paths: spare shared-memory blocks, ipc endpoints on the servers' node, and range
lookups in the storage units — each must give exactly what the general path gives."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from transferqueue import RemoteError, TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue
from transferqueue.shm_layout import HEADER
from transferqueue.spares import SpareBlocks
from transferqueue.transport import INDEX, server_addresses
from transferqueue.wire import id_range

KiB = 1024


def part() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def test_steady_puts_allocate_once_per_unit(shm_client):
    """After the first put, each put writes into the spare block the previous put's reply leased."""
    before = [shm_client.unit_stats(u)["requests"].get("alloc", [0])[0] for u in (0, 1)]
    batches = [torch.full((16, 4096), float(i)) for i in range(5)]  # 256 KiB, 8 samples on each unit
    metas = [shm_client.put({"x": b}, partition=part()) for b in batches]
    after = [shm_client.unit_stats(u)["requests"].get("alloc", [0])[0] for u in (0, 1)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    for meta, b in zip(metas, batches, strict=True):
        assert torch.equal(shm_client.get_data(meta)["x"], b)
        shm_client.clear(meta.partition)


@pytest.mark.parametrize("mapped", [False, True])
def test_spare_block_is_taken_back_when_the_unit_needs_room(mapped):
    """A unit that needs room revokes (unlinks) spares nobody wrote yet; the spare's client allocates
    again, whether it had never mapped the spare (open fails) or had (the unit answers full)."""
    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=1024 * KiB, request_timeout_s=10.0)
    with start_transferqueue(cfg) as servers:
        handle = dataclasses.replace(servers.handle, shm_min_bytes=0)
        with TQClient(handle) as a, TQClient(handle) as b:
            first = torch.randn(64, 1024)  # 256 KiB; its reply leases `a` a 256 KiB spare
            a.put({"x": first}, partition="a")
            if mapped:  # recycle the first block as a's next spare: a has it mapped already
                a.clear("a")
                first = torch.randn(64, 1024)
                a.put({"x": first}, partition="a")
            spare = a.spares.held(0)
            assert (spare in a.shm.maps) == mapped
            assert a.unit_stats(0)["used_bytes"] == 2 * (256 * KiB + HEADER)  # the put's block and a's spare
            big = torch.randn(150, 1024)  # 600 KiB: fits only if a's spare is taken back
            meta_b = b.put({"x": big}, partition="b", timeout_s=1)
            assert torch.equal(b.get_data(meta_b)["x"], big)
            b.clear("b")
            second = torch.randn(64, 1024)
            meta_a = a.put({"x": second}, partition="a2", timeout_s=2)
            assert torch.equal(a.get_data(meta_a)["x"], second)
            assert a.get("x", 64, "t", "a")["x"].equal(first)
            assert spare not in a.shm.maps  # a unmapped the revoked block


def test_clients_on_the_servers_node_use_ipc_and_others_tcp(tq_servers):
    handle = tq_servers.handle
    local = server_addresses(handle)
    assert all(addr.startswith("ipc://") for addr in local.values())
    assert local[INDEX] == handle.index_local_address and local[0] == handle.unit_local_addresses[0]
    remote = dataclasses.replace(handle, index_node="elsewhere", unit_nodes=["elsewhere"] * len(handle.unit_nodes))
    assert server_addresses(remote) == {INDEX: handle.index_address, 0: handle.unit_addresses[0],
                                        1: handle.unit_addresses[1]}
    assert handle.index_address.startswith("tcp://127.0.0.1:")
    with TQClient(remote) as client:  # over TCP and frames only, same results
        data = torch.arange(40.0).view(10, 4)
        meta = client.put({"x": data}, partition=(p := part()))
        assert torch.equal(client.get("x", 10, "t", p)["x"], data) and len(meta) == 10


def test_range_and_scattered_lookups_agree(client):
    """Two puts of one field make two chunks; gets and clears across, inside and between them."""
    p = part()
    meta = client.put({"x": torch.arange(12.0).view(12, 1)}, partition=p)
    ids = meta.sample_ids
    client.put({"y": torch.arange(6.0).view(6, 1)}, partition=p, sample_ids=ids[:6])
    client.put({"y": torch.arange(6.0, 12.0).view(6, 1)}, partition=p, sample_ids=ids[6:])
    with pytest.raises(RemoteError, match="already"):
        client.put({"y": torch.zeros(4, 1)}, partition=p, sample_ids=ids[4:8])
    whole = client.get_data(meta, ["x", "y"])
    assert torch.equal(whole["y"], whole["x"])
    inside = dataclasses.replace(meta, sample_ids=ids[7:10], tags=meta.tags[7:10])
    assert client.get_data(inside, ["y"])["y"].view(-1).tolist() == [7.0, 8.0, 9.0]
    scattered = dataclasses.replace(meta, sample_ids=[ids[9], ids[2], ids[5]], tags=meta.tags[:3])
    assert client.get_data(scattered, ["y"])["y"].view(-1).tolist() == [9.0, 2.0, 5.0]
    assert client.clear(p, ids[4:8]) == 4  # across the chunk boundary
    with pytest.raises(RemoteError, match="missing|cleared"):
        client.get_data(dataclasses.replace(meta, sample_ids=ids[3:5], tags=meta.tags[3:5]), ["y"])
    rest = dataclasses.replace(meta, sample_ids=ids[:4] + ids[8:], tags=meta.tags[:4] + meta.tags[8:])
    assert client.get_data(rest, ["y"])["y"].view(-1).tolist() == [0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0]


@pytest.mark.parametrize(("ids", "first"), [([3, 4, 5], 3), ([0], 0), ([], None), ([4, 3], None), ([1, 3], None),
                                            ([-1, 0], None), ([1, True, 3], None), ([1.0, 2.0], None), ("012", None)])
def test_id_range_only_accepts_consecutive_ints(ids, first):
    assert id_range(ids) == first


def test_a_put_whose_copy_fails_is_undone(shm_client, monkeypatch):
    """The copy into the block runs after the put is sent; if it fails the put raises and leaves nothing."""
    import numpy as np

    from transferqueue import client as client_mod

    p = part()
    before = [shm_client.unit_stats(u)["stored_bytes"] for u in (0, 1)]
    copyto = np.copyto

    def broken_copyto(dst, src):
        raise MemoryError("copy failed")

    monkeypatch.setattr(client_mod.np, "copyto", broken_copyto)
    with pytest.raises(MemoryError, match="copy failed"):
        shm_client.put({"x": torch.ones(8, 4096)}, partition=p)
    monkeypatch.setattr(client_mod.np, "copyto", copyto)
    assert [shm_client.unit_stats(u)["stored_bytes"] for u in (0, 1)] == before
    assert shm_client.get_meta(["x"], 8, "t", p).sample_ids == []
    meta = shm_client.put({"x": torch.ones(8, 4096)}, partition=p)  # the client still works
    assert torch.equal(shm_client.get_data(meta)["x"], torch.ones(8, 4096))


def test_threads_sharing_a_client_never_share_a_spare_block(shm_client):
    """Concurrent puts through one client: each block is written by one put only, so every batch reads
    back exactly as it was put."""
    import threading

    p = part()
    results: dict[int, list] = {}

    def worker(k: int) -> None:
        results[k] = []
        for i in range(15):
            data = torch.full((8, 8192), float(k * 100 + i))  # 256 KiB, on both units
            results[k].append((shm_client.put({"x": data}, partition=p), data))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3]
    for puts in results.values():
        assert len(puts) == 15
        for meta, data in puts:
            assert torch.equal(shm_client.get_data(meta)["x"], data)
    shm_client.clear(p)


def test_a_put_one_unit_rejects_is_undone_on_the_others(shm_client, rejecting_unit):
    """Unit 1 rejects its part while unit 0 stores its part in the same round: the put raises, and unit 0's
    part is cleared again (nothing of a failed put is kept)."""
    p = part()
    before = [shm_client.unit_stats(u)["stored_bytes"] for u in (0, 1)]
    with rejecting_unit(1), pytest.raises(RemoteError, match="offset"):
        shm_client.put({"x": torch.ones(8, 4096)}, partition=p)  # ids span both units (route_block 4)
    assert [shm_client.unit_stats(u)["stored_bytes"] for u in (0, 1)] == before
    assert shm_client.get_meta(["x"], 1, "t", p).sample_ids == []


def test_a_get_that_races_a_clear_and_a_new_put_raises_instead_of_returning_their_bytes(monkeypatch):
    """Between a unit's get reply and the reader's copy, the ids are cleared and another client's put
    takes the freed block: the reader must get an error, not the other put's bytes."""
    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=16 << 20)
    with start_transferqueue(cfg) as servers:
        handle = dataclasses.replace(servers.handle, shm_min_bytes=0)
        with TQClient(handle) as reader, TQClient(handle) as other:
            meta = reader.put({"x": torch.zeros(16, 4096)}, partition="a")
            assemble = TQClient._assemble
            raced = []

            def clear_and_put_first(self, *args):
                if not raced:  # the reply named the block; now it is freed and leased again
                    raced.append(other.clear("a"))
                    other.put({"x": torch.ones(16, 4096)}, partition="b")
                return assemble(self, *args)

            monkeypatch.setattr(TQClient, "_assemble", clear_and_put_first)
            with pytest.raises(RemoteError, match="cleared while being read"):
                reader.get_data(meta)
            assert raced == [16]
            monkeypatch.setattr(TQClient, "_assemble", assemble)
            got = reader.get("x", 16, "t", "b")["x"]  # the new put reads back intact
            assert torch.equal(got, torch.ones(16, 4096))


def test_an_object_field_raced_by_a_clear_raises_the_typed_error_not_a_msgpack_one(monkeypatch):
    """The same race on an ``object`` field: the freed block now holds another put's msgpack bytes, which
    decoded with the old row lengths are not one object each (``msgpack.ExtraData``). The lease check runs
    before anything is decoded, so the reader gets the typed "cleared while being read" error."""
    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=16 << 20)
    with start_transferqueue(cfg) as servers:
        handle = dataclasses.replace(servers.handle, shm_min_bytes=0)
        with TQClient(handle) as reader, TQClient(handle) as other:
            meta = reader.put({"s": ["a"] * 16}, partition="a")  # 2 msgpack bytes per row
            assemble = TQClient._assemble
            raced = []

            def clear_and_put_first(self, *args):
                if not raced:
                    raced.append(other.clear("a"))
                    other.put({"s": [1] * 32}, partition="b")  # 1 byte per row, into the freed block
                return assemble(self, *args)

            monkeypatch.setattr(TQClient, "_assemble", clear_and_put_first)
            with pytest.raises(RemoteError, match="cleared while being read"):
                reader.get_data(meta)
            assert raced == [16]
            monkeypatch.setattr(TQClient, "_assemble", assemble)
            assert reader.get("s", 32, "t", "b")["s"] == [1] * 32


def test_a_get_whose_block_was_destroyed_by_a_clear_raises_the_typed_error(monkeypatch):
    """Between the get reply and the reader's first mapping of the block, the ids are cleared and another
    put needs the room: the unit destroys (unlinks) the pooled block. Opening it fails; the reader gets
    the typed "cleared while being read" error, not FileNotFoundError."""
    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=1024 * KiB, request_timeout_s=10.0)
    with start_transferqueue(cfg) as servers:
        handle = dataclasses.replace(servers.handle, shm_min_bytes=0)
        with TQClient(handle) as writer, TQClient(handle) as reader:
            meta = writer.put({"x": torch.zeros(64, 1024)}, partition="a")  # 256 KiB + a 256 KiB spare
            assemble = TQClient._assemble
            raced = []

            def clear_and_fill_first(self, *args):
                if not raced:
                    raced.append(writer.clear("a"))
                    writer.spares = SpareBlocks()  # the writer's spare is revoked too: only room matters here
                    raced.append(len(writer.put({"x": torch.ones(200, 1024)}, partition="b", timeout_s=2)))
                return assemble(self, *args)

            monkeypatch.setattr(TQClient, "_assemble", clear_and_fill_first)
            with pytest.raises(RemoteError, match="cleared while being read"):
                reader.get_data(meta)
            assert raced == [64, 200]
