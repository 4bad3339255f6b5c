"""Bucket format: placement, packing (full tensors and Shard(0) rows), unpacking, casts, wire records."""

from __future__ import annotations

import pytest
import torch

from checkpointengine.bucket import (
    ALIGN_BYTES,
    BucketPlanner,
    BucketUnpacker,
    RowShard,
    TensorEntry,
    write_full,
    write_rows,
)
from checkpointengine.naming import engine_dtype_of, to_engine_dtype
from checkpointengine.protocol import BucketReady, ProtocolError, Want, decode, encode


def _pack(named, bucket_bytes, engine_dtype=None):
    """Pack ``named`` full tensors; returns [(entries, buffer copy)] per bucket."""
    buffers: dict[int, torch.Tensor] = {}
    out = []
    current = {}

    def on_write(index, entry):
        buf = buffers.setdefault(index, torch.zeros(bucket_bytes, dtype=torch.uint8))
        write_full(buf, entry, current["t"])

    def on_close(bucket):
        out.append((bucket.entries, buffers.pop(bucket.index)[: bucket.used_bytes].clone()))

    planner = BucketPlanner(bucket_bytes, on_close)
    for name, tensor in named:
        current["t"] = tensor
        dtype = engine_dtype_of(tensor, engine_dtype) if engine_dtype else tensor.dtype
        planner.place(name, dtype, tuple(tensor.shape), on_write)
    planner.finish()
    return out, planner


def _unpack(buckets):
    unpacker = BucketUnpacker()
    got = {}
    for entries, buf in buckets:
        got.update(unpacker.add(entries, buf, copy=True))
    unpacker.finish()
    return got


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [
        ("fp32", torch.randn(33, 7, generator=g)),
        ("bf16", torch.randn(5, 9, generator=g).bfloat16()),
        ("fp16", torch.randn(17, generator=g).half()),
        ("int64", torch.randint(-(2**40), 2**40, (13,), generator=g)),
        ("int32", torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int32)),
        ("bool", torch.rand(11, generator=g) > 0.5),
        ("empty", torch.empty(0, 4)),
        ("scalar", torch.tensor(3.25)),
        ("big", torch.randn(1000, generator=g)),  # 4000 bytes > 1024-byte bucket: chunked
        ("tail", torch.randn(3, generator=g)),  # ends in a last partial bucket
    ]


def test_round_trip_is_bit_exact_for_every_dtype_chunked_and_empty():
    named = _mixed()
    buckets, planner = _pack(named, 1024)
    assert planner.num_buckets == len(buckets) >= 5
    assert all(buf.numel() <= 1024 for _, buf in buckets)
    assert buckets[-1][1].numel() < 1024, "the last bucket is partial"
    big = [e for entries, _ in buckets for e in entries if e.name == "big"]
    assert len(big) == 4 and [e.chunk[0] for e in big] == [0, 1024, 2048, 3072]
    got = _unpack(buckets)
    assert list(got) == [n for n, _ in named]
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def test_engine_dtype_cast_on_pack():
    """Mostly bf16, some fp32, one fp16; engine bf16 → every float arrives bf16 with the bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    named = [(f"w{i}", torch.randn(8, 8, generator=g).bfloat16()) for i in range(5)]
    named += [("norm", torch.randn(8, generator=g)), ("bias", torch.randn(8, generator=g)),
              ("half", torch.randn(4, 4, generator=g).half()), ("ids", torch.arange(5))]
    buckets, _ = _pack(named, 256, engine_dtype=torch.bfloat16)
    for entries, buf in buckets:
        for e in entries:
            view = buf[e.offset: e.offset + e.nbytes].view(e.torch_dtype)
            assert view.numel() * e.torch_dtype.itemsize == e.nbytes
    got = _unpack(buckets)
    for name, tensor in named:
        if tensor.is_floating_point():
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
        else:
            assert torch.equal(got[name], tensor)
    declared = {e.name: e.dtype for entries, _ in buckets for e in entries}
    assert declared["norm"] == "bfloat16" and declared["ids"] == "int64"


def test_already_engine_dtype_tensor_is_not_copied(monkeypatch):
    t = torch.randn(64, 32).bfloat16()
    assert to_engine_dtype(t, torch.bfloat16) is t
    calls = []
    for method in ("to", "clone", "contiguous", "float", "bfloat16"):
        original = getattr(torch.Tensor, method)

        def spy(self, *a, _m=method, _o=original, **k):
            calls.append(_m)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, spy)
    buf = torch.zeros(8192, dtype=torch.uint8)
    write_full(buf, TensorEntry("t", "bfloat16", (64, 32), 0, t.nbytes, (0, t.nbytes)), t)
    monkeypatch.undo()
    assert calls == []
    assert torch.equal(buf[: t.nbytes].view(torch.bfloat16).view(64, 32), t)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_rows_written_by_each_rank_equal_the_full_pack(world):
    """Each rank writes only its Shard(0) rows (uneven split, one rank empty) into shared buckets."""
    named = [(n, t) for n, t in _mixed() if t.dim() >= 1]
    named.append(("rows", torch.randn(2, 300)))  # 2 rows, chunked across buckets
    full, _ = _pack(named, 1024, engine_dtype=torch.bfloat16)
    shared: dict[int, torch.Tensor] = {}
    layouts = []
    current = {}

    def on_write(index, entry):
        buf = shared.setdefault(index, torch.zeros(1024, dtype=torch.uint8))
        write_rows(buf, entry, current["shard"])

    for rank in range(world):
        planner = BucketPlanner(1024, layouts.append if rank == 0 else (lambda bucket: None))
        for name, t in named:
            rows = t.shape[0]
            per = -(-rows // world)  # FSDP2 split: ceil(rows / world) rows per rank, the last ones short
            lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
            current["shard"] = RowShard(name, t[lo:hi], lo, tuple(t.shape))
            planner.place(name, engine_dtype_of(t, torch.bfloat16), tuple(t.shape), on_write)
        planner.finish()
    assert [b.entries for b in layouts] == [entries for entries, _ in full]
    for bucket, (_, buf) in zip(layouts, full, strict=True):
        assert torch.equal(shared[bucket.index][: bucket.used_bytes], buf)


def test_planner_rejects_duplicates_and_aligns_offsets():
    planner = BucketPlanner(4096, lambda b: None)
    placed = planner.place("a", torch.float16, (3,)) + planner.place("b", torch.float64, (5,))
    assert [e.offset % ALIGN_BYTES for _, e in placed] == [0, 0]
    with pytest.raises(ValueError, match="sent twice"):
        planner.place("a", torch.float32, (1,))
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPlanner(8, lambda b: None)


def test_unpacker_rejects_bad_layouts():
    buf = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        list(BucketUnpacker().add([TensorEntry("x", "float32", (64,), 0, 256, (0, 256))], buf))
    with pytest.raises(ValueError, match="first chunk"):
        list(BucketUnpacker().add([TensorEntry("x", "float32", (64,), 0, 64, (64, 256))], buf))
    unpacker = BucketUnpacker()
    list(unpacker.add([TensorEntry("x", "float32", (64,), 0, 128, (0, 256))], buf))
    with pytest.raises(ValueError, match="incomplete"):
        unpacker.finish()
    with pytest.raises(ValueError, match="outside"):
        RowShard("x", torch.zeros(3, 2), 2, (4, 2))


def test_control_messages_round_trip_and_reject_garbage():
    entries = [TensorEntry("a.b", "bfloat16", (2, 3), 64, 12, (0, 12))]
    msg = BucketReady(7, 1, entries, 76, slot=1)
    assert decode(encode(msg)) == msg
    assert decode(encode(Want(587, 586, 2**47 + 3))) == Want(587, 586, 2**47 + 3)
    for junk in (b"\xc1", b"\x93\x01\x02\x03", encode(Want(1, 0, 7)).replace(b"Want", b"Nope")):
        with pytest.raises(ProtocolError):
            decode(junk)


def test_pooled_unpacking_reuses_memory_across_updates_and_stays_exact():
    pool: dict[str, torch.Tensor] = {}
    first, second = _mixed(), [(n, t + 1 if t.is_floating_point() else t) for n, t in _mixed()]
    got1 = {}
    unpacker = BucketUnpacker(pool=pool)
    for entries, buf in _pack(first, 1024)[0]:
        got1.update(unpacker.add(entries, buf))
    ptrs = {n: t.data_ptr() for n, t in got1.items() if t.numel()}
    unpacker = BucketUnpacker(pool=pool)
    got2 = {}
    for entries, buf in _pack(second, 1024)[0]:
        got2.update(unpacker.add(entries, buf))
    unpacker.finish()
    assert {n: t.data_ptr() for n, t in got2.items() if t.numel()} == ptrs  # same memory, no new pages
    for name, tensor in second:
        assert torch.equal(_bits(got2[name]), _bits(tensor)), name
