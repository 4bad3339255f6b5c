"""Adversarial probes of the latency fast paths (spare shared-memory blocks, copy after send, ipc endpoints,
range lookups): leases that outlive their lessee, puts that fail half-way, malformed ids, CURVE on both
endpoints. Each test pins a problem an adversarial review found (all fixed) or a property worth keeping."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import tempfile
import threading
import time
import uuid

import pytest
import torch
import zmq

from common.curve import make_job_keys
from transferqueue import RemoteError, TQClient, wire
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue
from transferqueue.records import Full, Timeout
from transferqueue.shm_layout import HEADER
from transferqueue.storage import StorageUnit

KiB = 1024


def part() -> str:
    return f"adv-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def small_tq():
    """Two units of 1 MiB each (route_block 4), so a few clients' spares and pooled blocks fill them."""
    cfg = TransferQueueConfig(num_storage_units=2, capacity_bytes=1024 * KiB, route_block=4, request_timeout_s=20.0)
    servers = start_transferqueue(cfg)
    yield servers
    servers.shutdown()


@pytest.fixture
def unit():
    """An in-process storage unit (no loop: requests go straight to ``handle``) with a 50 ms lease."""
    u = StorageUnit("tcp://127.0.0.1:0", 4 << 20, lease_s=0.05)
    yield u
    u.close()


def _col(name: str, rows: int, row_bytes: int = 1024) -> dict:
    return {"name": name, "dtype": "uint8", "shape": [row_bytes], "nbytes": rows * row_bytes}


def test_a_put_may_not_write_over_the_blocks_header(unit):
    """The first HEADER bytes of a block hold the unit's lease number (readers check it after copying)."""
    block = unit.handle(b"A", {"op": "alloc", "nbytes": 4 * KiB}, [])[0]["block"]
    with pytest.raises(wire.WireError, match="overlaps"):
        unit.handle(b"A", {"op": "put", "ids": [0, 1], "columns": [_col("x", 2)],
                           "shm": {"block": block, "offsets": [HEADER - 8]}}, [])


def test_a_put_into_an_expired_spare_is_refused_and_the_block_never_reused(unit):
    """Client A's spare expires at the unit (A's put was delayed past the lease). The unit destroys it
    rather than pooling it: B's next alloc gets another block, and A's late put naming the old one is
    answered ``full`` (A allocates again) — two puts can never share a block."""
    first = unit.handle(b"A", {"op": "alloc", "nbytes": 2 * KiB}, [])[0]
    head = unit.handle(b"A", {"op": "put", "ids": [0, 1], "columns": [_col("x", 2)], "lease": 2 * KiB,
                              "shm": {"block": first["block"], "offsets": [HEADER]}}, [])[0]
    spare = head["lease"]["block"]
    time.sleep(0.1)
    unit.tick()  # the spare's lease ended
    b_block = unit.handle(b"B", {"op": "alloc", "nbytes": 2 * KiB}, [])[0]["block"]
    assert b_block != spare and spare not in unit.pending
    late = {"op": "put", "ids": [2, 3], "columns": [_col("x", 2)], "shm": {"block": spare, "offsets": [HEADER]}}
    with pytest.raises(Full):
        unit.handle(b"A", late, [])
    own = {"op": "put", "ids": [4, 5], "columns": [_col("x", 2)], "shm": {"block": b_block, "offsets": [HEADER]}}
    assert unit.handle(b"B", own, [])[0]["nbytes"] > 0  # B's put of its own block still works


def test_a_lease_that_cannot_fit_takes_no_spare_back(unit):
    """A put asking for a spare larger than the unit (a malformed ``lease``, or a client's 8 MiB ask on a
    nearly full unit) gets no spare, and must not revoke other clients' spares nor empty the pool for it."""
    spares = []
    for ids in ([0, 1], [2, 3]):
        block = unit.handle(b"A", {"op": "alloc", "nbytes": 2 * KiB}, [])[0]["block"]
        head = unit.handle(b"A", {"op": "put", "ids": ids, "columns": [_col("x", 2)], "lease": 2 * KiB,
                                  "shm": {"block": block, "offsets": [HEADER]}}, [])[0]
        spares.append(head["lease"]["block"])
    head = unit.handle(b"M", {"op": "put", "ids": [10, 11], "columns": [_col("y", 2)], "lease": 2**62},
                       [zmq.Frame(bytes(2 * KiB))])[0]
    assert "lease" not in head  # the put itself is stored; no spare that big
    assert not any(s in unit.gone for s in spares)
    assert all(s in unit.pending for s in spares)


@pytest.mark.parametrize("ids", [
    [2.0, 3.0], [-3, -2], [2**64 - 1, 7],
    [True, 2], [2**63, 2**63 + 1],
])
def test_ids_outside_non_negative_int64_are_wire_errors(unit, ids):
    """Ids that look like a range but are not int64 sample ids (floats, negatives, bools, > 2**63-1) are
    refused with WireError on put, get and clear, and nothing is stored."""
    frame = zmq.Frame(bytes(len(ids) * KiB))
    with pytest.raises(wire.WireError):
        unit.handle(b"C", {"op": "put", "ids": ids, "columns": [_col("z", len(ids))]}, [frame])
    assert unit.stored_bytes == 0
    for op in ({"op": "get", "ids": ids, "fields": ["z"]}, {"op": "clear", "ids": ids}):
        with pytest.raises(wire.WireError):
            unit.handle(b"C", op, [])


def test_a_put_that_times_out_on_one_unit_leaves_nothing_on_any_unit(small_tq):
    """Unit 1 stalls (SIGSTOP) while unit 0 stores its part; the put raises Timeout. Once unit 1 runs again,
    neither unit may keep bytes of the failed put, and the index has no sample of it."""
    handle = dataclasses.replace(small_tq.handle, shared_memory=False, request_timeout_s=0.5)
    p = part()
    with TQClient(handle) as client:
        before = [client.unit_stats(u)["stored_bytes"] for u in (0, 1)]
        pid = small_tq.procs[2].pid  # procs: index, unit 0, unit 1
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(1.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            with pytest.raises(Timeout):
                client.put({"x": torch.ones(8, 256)}, partition=p, timeout_s=0.2)  # ids 0-3 on unit 0, 4-7 on 1
        finally:
            resume.join()
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.3)  # unit 1 handles the put it had queued
        assert client.get_meta(["x"], 1, "t", p).sample_ids == []
        assert [client.unit_stats(u)["stored_bytes"] for u in (0, 1)] == before


def test_spares_of_many_clients_never_make_a_put_full(small_tq):
    """Three clients each hold a spare on each unit of 1 MiB; a put that needs room takes other clients'
    spares and pooled blocks back, so puts never fail while little is stored, every batch reads back as
    put, and after the clears nothing is stored and used bytes stay within capacity."""
    handle = dataclasses.replace(small_tq.handle, shm_min_bytes=0)
    clients = [TQClient(handle) for _ in range(3)]
    try:
        before = [clients[0].unit_stats(u)["stored_bytes"] for u in (0, 1)]
        for i in range(4):
            for k, c in enumerate(clients):
                p = part()
                data = torch.full((8, 40 * KiB // 4), float(10 * k + i))  # 160 KiB on each unit
                meta = c.put({"x": data}, partition=p, timeout_s=2)
                other = clients[(k + 1) % 3]  # another client reads it (maps the same blocks)
                assert torch.equal(other.get_data(meta)["x"], data)
                assert c.clear(p) == 8
        for u in (0, 1):
            stats = clients[0].unit_stats(u)
            assert stats["stored_bytes"] == before[u]
            assert stats["used_bytes"] <= stats["capacity_bytes"]
    finally:
        for c in clients:
            c.close()


def test_async_puts_sharing_a_client_never_share_a_spare_block(small_tq):
    """Concurrent ``aput`` / ``aget_data`` / ``aclear`` tasks on one event loop through one client (puts in
    flight together take spares from one table): each task reads back exactly its own bytes."""
    handle = dataclasses.replace(small_tq.handle, shm_min_bytes=0)

    async def worker(client: TQClient, k: int) -> int:
        p = part()
        for i in range(5):
            data = torch.full((8, 4 * KiB), float(k * 100 + i))  # 64 KiB on each unit
            meta = await client.aput({"x": data}, partition=p, timeout_s=2)
            assert torch.equal((await client.aget_data(meta))["x"], data)
            assert await client.aclear(p, meta.sample_ids) == 8
        return k

    async def main(client: TQClient) -> list[int]:
        return list(await asyncio.gather(*(worker(client, k) for k in range(3))))

    with TQClient(handle) as client:
        assert asyncio.run(main(client)) == [0, 1, 2]


def test_a_rejected_put_leaves_no_block_holding_capacity(small_tq, rejecting_unit):
    """Unit 0 rejects its part of a shared-memory put (bad offsets). The put fails (fine), but the block
    allocated for it must not keep holding unit 0's capacity: another client's put that needs most of
    each unit must fit at once."""
    handle = dataclasses.replace(small_tq.handle, shm_min_bytes=0)
    with TQClient(handle) as a, TQClient(handle) as b:
        with rejecting_unit(0), pytest.raises(RemoteError, match="offset"):
            a.put({"x": torch.zeros(8, 75 * KiB // 4)}, partition=part())  # 300 KiB on each unit
        p = part()
        big = torch.ones(8, 200 * KiB // 4)  # 800 KiB on each unit of 1 MiB
        meta = b.put({"x": big}, partition=p, timeout_s=1)
        assert torch.equal(b.get_data(meta)["x"], big)
        b.clear(p)


def _ping(endpoint: str, curve=None, wait_ms: int = 300) -> dict | None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.curve_serverkey = curve.server_public.encode()
            sock.curve_publickey = curve.client_public.encode()
            sock.curve_secretkey = curve.client_secret.encode()
        sock.connect(endpoint)
        sock.send(wire.pack({"op": "ping", "rid": 7}))
        return wire.unpack_header(sock.recv()) if sock.poll(wait_ms) else None
    finally:
        ctx.destroy(linger=0)


def _serve(server: StorageUnit) -> threading.Thread:
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    return loop


def test_curve_refuses_keyless_peers_on_tcp_and_ipc():
    """A CURVE server's ipc:// endpoint is as closed as its TCP one: a keyless or wrongly keyed peer gets no
    reply, the job's client is served on both. (test_security's clients now reach the servers over ipc
    only, so this also keeps the TCP side covered.)"""
    keys, other = make_job_keys(), make_job_keys()
    wrong = dataclasses.replace(keys, client_public=other.client_public, client_secret=other.client_secret)
    with tempfile.TemporaryDirectory(prefix="tq-adv-") as d:
        server = StorageUnit("tcp://127.0.0.1:0", 1 << 20, curve=keys, local_address=f"ipc://{d}/u.sock")
        loop = _serve(server)
        try:
            for endpoint in (server.endpoint, server.local_endpoint):
                assert _ping(endpoint) is None
                assert _ping(endpoint, wrong) is None
                assert _ping(endpoint, keys, wait_ms=5000)["ok"] is True
        finally:
            server.stop()
            loop.join(timeout=5)
        assert not loop.is_alive()


def test_a_stopped_server_removes_its_ipc_socket_file():
    """A server that stops on its own (SIGTERM from a killed launcher via PDEATHSIG, a Ray actor killed
    before ``stop``) must not leave its socket file: nobody else cleans the run directory then."""
    with tempfile.TemporaryDirectory(prefix="tq-adv-") as d:
        path = os.path.join(d, "u.sock")
        server = StorageUnit("tcp://127.0.0.1:0", 1 << 20, local_address=f"ipc://{path}")
        loop = _serve(server)
        assert _ping(f"ipc://{path}", wait_ms=5000)["ok"] is True
        server.stop()
        loop.join(timeout=5)
        assert not loop.is_alive()
        assert not os.path.exists(path)


def test_a_cleared_block_is_not_reused_while_zmq_still_sends_it(unit):
    """A frames-path get (a remote reader) replies with zero-copy frames of the block; ZMQ reads them after
    the handler returns. A clear meanwhile must not hand the block to the next alloc until ZMQ is done."""
    import gc

    block = unit.handle(b"A", {"op": "alloc", "nbytes": 4 * KiB}, [])[0]["block"]
    unit.handle(b"A", {"op": "put", "ids": [0, 1], "columns": [_col("x", 2)],
                       "shm": {"block": block, "offsets": [HEADER]}}, [])
    head, frames = unit.handle(b"R", {"op": "get", "ids": [0, 1], "fields": ["x"]}, [])  # frames, not sent yet
    assert head["columns"][0]["runs"][0][0] is None and len(frames) == 1
    unit.handle(b"A", {"op": "clear", "ids": [0, 1]}, [])
    unit.tick()
    assert unit.handle(b"B", {"op": "alloc", "nbytes": 4 * KiB}, [])[0]["block"] != block
    assert [b.name for b in unit.draining] == [block]
    del frames, head
    gc.collect()  # the frame is released: ZMQ is done with it
    unit.tick()
    assert not unit.draining and any(b.name == block for pool in unit.free.values() for b in pool)
