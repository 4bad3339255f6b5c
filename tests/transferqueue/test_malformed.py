"""Malformed and hostile messages get an error reply; the server keeps serving the next good request."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from transferqueue import wire

MiB = 1024**2
GOOD_COL = {"name": "x", "dtype": "int32", "shape": [2], "nbytes": 8}


def put(ids, cols, **extra) -> dict:
    return {"op": "put", "ids": ids, "columns": cols, **extra}


# (name, frames) — frames[0] is the header (bytes); the rest are data frames
UNIT_CASES = [
    ("bad msgpack", [b"\xc1\xc1"]),
    ("empty header frame", [b""]),
    ("header is a list", [wire.pack([1, 2])]),  # type: ignore[arg-type]
    ("no op", [wire.pack({"rid": 1})]),
    ("op not a string", [wire.pack({"op": 7})]),
    ("unknown op", [wire.pack({"op": "launch_missiles"})]),
    ("oversized header", [msgpack.packb({"op": "put", "pad": b"x" * (wire.MAX_HEADER_BYTES + 1)})]),
    ("too few frames", [wire.pack(put([0], [GOOD_COL]))]),
    ("too many frames", [wire.pack(put([0], [GOOD_COL])), b"\0" * 8, b"\0" * 8]),
    ("unknown dtype", [wire.pack(put([0], [dict(GOOD_COL, dtype="int33")])), b"\0" * 8]),
    ("nbytes vs shape", [wire.pack(put([0], [dict(GOOD_COL, shape=[3])])), b"\0" * 8]),
    ("frame length", [wire.pack(put([0], [GOOD_COL])), b"\0" * 7]),
    ("ids not a list", [wire.pack(put("0", [GOOD_COL])), b"\0" * 8]),
    ("negative id", [wire.pack(put([-1], [GOOD_COL])), b"\0" * 8]),
    ("duplicate ids", [wire.pack(put([1, 1], [dict(GOOD_COL, nbytes=16)])), b"\0" * 16]),
    ("shapes count", [wire.pack(put([0, 1], [{"name": "x", "dtype": "int8", "shapes": [[1]], "nbytes": 1}])), b"\0"]),
    ("no columns", [wire.pack(put([0], []))]),
    ("negative dim", [wire.pack(put([0], [dict(GOOD_COL, shape=[-2])])), b"\0" * 8]),
    ("shm block never allocated", [wire.pack(put([0], [GOOD_COL], shm={"block": "hflow-tq-1-000000000000",
                                                                       "offsets": [0]}))]),
    ("get fields not a list", [wire.pack({"op": "get", "ids": [0], "fields": "x"})]),
    ("get unknown field", [wire.pack({"op": "get", "ids": [0], "fields": ["never-put"]})]),
    ("alloc negative", [wire.pack({"op": "alloc", "nbytes": -5})]),
    ("alloc beyond capacity", [wire.pack({"op": "alloc", "nbytes": 1 << 40})]),
    ("clear ids wrong type", [wire.pack({"op": "clear", "ids": {"a": 1}})]),
]

INDEX_CASES = [
    ("frames sent to the index", [wire.pack({"op": "ping"}), b"data"]),
    ("batch_size zero", [wire.pack({"op": "get_meta", "partition": "p", "fields": ["x"], "batch_size": 0,
                                    "task": "t"})]),
    ("unknown sampler", [wire.pack({"op": "get_meta", "partition": "p", "fields": ["x"], "batch_size": 1,
                                    "task": "t", "sampler": "nope"})]),
    ("notify columns not a list", [wire.pack({"op": "notify", "partition": "p", "ids": [], "columns": 3})]),
    ("partition not a string", [wire.pack({"op": "prepare_put", "partition": 5, "ids": None, "count": 1})]),
    ("unknown op", [wire.pack({"op": "drop_tables"})]),
    ("negative timeout", [wire.pack({"op": "get_meta", "partition": "p", "fields": ["x"], "batch_size": 1,
                                     "task": "t", "timeout_s": -1})]),
]


@pytest.fixture
def raw(tq_servers):
    ctx = zmq.Context()
    socks = {}

    def connect(addr: str) -> zmq.Socket:
        if addr not in socks:
            s = socks[addr] = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
        return socks[addr]

    yield connect
    ctx.destroy(linger=0)


def ask(sock: zmq.Socket, frames: list) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "no reply"
    reply = sock.recv_multipart()
    return msgpack.unpackb(reply[0], raw=False)


def test_case_count():
    assert len(UNIT_CASES) + len(INDEX_CASES) >= 20


@pytest.mark.parametrize("name,frames", UNIT_CASES, ids=[c[0] for c in UNIT_CASES])
def test_storage_unit_rejects_and_keeps_serving(raw, tq_servers, name, frames):
    sock = raw(tq_servers.handle.unit_addresses[0])
    reply = ask(sock, frames)
    assert reply["ok"] is False and reply["error"], name
    good = ask(sock, [wire.pack({"op": "ping", "rid": 99})])
    assert good == {"ok": True, "rid": 99}


@pytest.mark.parametrize("name,frames", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_index_rejects_and_keeps_serving(raw, tq_servers, name, frames):
    sock = raw(tq_servers.handle.index_address)
    reply = ask(sock, frames)
    assert reply["ok"] is False and reply["error"], name
    good = ask(sock, [wire.pack({"op": "ping", "rid": 5})])
    assert good == {"ok": True, "rid": 5}


def test_full_error_is_flagged(raw, tq_servers):
    reply = ask(raw(tq_servers.handle.unit_addresses[1]), [wire.pack({"op": "alloc", "nbytes": 1 << 40})])
    assert reply["full"] is True and "full" in reply["error"]
