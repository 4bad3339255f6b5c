"""Wire-format validation without sockets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transferqueue import wire


def test_every_dtype_has_a_name_and_itemsize():
    for name, dtype in wire.DTYPES.items():
        assert wire.dtype_name(dtype) == name
    sizes = {"bool": 1, "bfloat16": 2, "float16": 2, "int64": 8, "complex128": 16, "uint16": 2, "float8_e4m3fn": 1}
    assert {k: wire.ITEMSIZE[k] for k in sizes} == sizes


def test_encode_fixed_column_is_zero_copy():
    t = torch.arange(12, dtype=torch.int64).view(3, 4)
    desc, bufs = wire.encode_column("x", t, 3)
    assert desc == {"name": "x", "dtype": "int64", "shape": [4], "nbytes": 96}
    assert np.shares_memory(bufs[0], t.numpy())
    assert wire.validate_column(desc, 3)["count"] == 3


def test_validate_rejects_inconsistent_descriptors():
    good = {"name": "x", "dtype": "float32", "shape": [2], "nbytes": 16}
    wire.validate_column(good, 2)
    bad = [
        dict(good, dtype="float33"),
        dict(good, nbytes=15),
        dict(good, shape=[-1]),
        {"name": "x", "dtype": "float32", "shapes": [[1]], "nbytes": 4},  # 1 shape for 2 samples
        {"name": "x", "dtype": "float32", "shape": [2], "shapes": [[2], [2]], "nbytes": 16},
        "not a map",
    ]
    for desc in bad:
        with pytest.raises(wire.WireError):
            wire.validate_column(desc, 2)


def test_validate_frames_checks_count_and_lengths():
    col = wire.validate_column({"name": "x", "dtype": "int8", "shape": [3], "nbytes": 6}, 2)
    wire.validate_frames([col], [b"abcdef"])
    with pytest.raises(wire.WireError, match="frame of 5 bytes"):
        wire.validate_frames([col], [b"abcde"])
    with pytest.raises(wire.WireError, match="expected 1 data frames"):
        wire.validate_frames([col], [b"abc", b"def"])


def test_header_limits_and_garbage():
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.unpack_header(b"\x80" * 100, max_bytes=10)
    with pytest.raises(wire.WireError, match="not valid msgpack"):
        wire.unpack_header(b"\xc1")
    with pytest.raises(wire.WireError, match="must be a msgpack map"):
        wire.unpack_header(wire.pack([1, 2]))  # type: ignore[arg-type]


def test_object_column_round_trip():
    desc, bufs = wire.encode_column("gt", ["a", {"k": 1}, 3.5], 3)
    col = wire.validate_column(desc, 3)
    assert wire.decode_column(col, np.frombuffer(bufs[0], np.uint8).copy()) == ["a", {"k": 1}, 3.5]
    with pytest.raises(TypeError, match="msgpack"):
        wire.encode_column("gt", [object()], 1)
