"""One table of dtype names (``common.dtypes``) serves the data plane, the weight plane and SGLang's API."""

from __future__ import annotations

import pytest
import torch

from checkpointengine.bucket import BucketPlanner, BucketUnpacker, write_full
from common.dtypes import DTYPES, FLOAT_DTYPES, dtype_from_name, dtype_name
from rollers import sglang_protocol as proto
from transferqueue import wire


def test_names_round_trip_and_unknown_names_are_refused():
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name and dtype_from_name(name) is dtype
        assert dtype_from_name(f"torch.{name}") is dtype  # SGLang clients send str(dtype)
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        dtype_from_name("float33")
    with pytest.raises(TypeError, match="no wire name"):
        dtype_name(torch.quint8)
    assert set(FLOAT_DTYPES) <= set(DTYPES)


def test_the_planes_and_the_sglang_api_share_the_table():
    assert wire.DTYPES is DTYPES
    assert proto.dtype_from_sglang("torch.bfloat16") is torch.bfloat16
    assert proto.dtype_to_sglang(torch.float16) == "float16"
    with pytest.raises(proto.ProtocolError, match="not a torch dtype"):
        proto.dtype_from_sglang("Size")  # an attribute of torch that is no dtype


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_wire_dtype_travels_through_a_weight_bucket(name):
    """What the data plane can carry, the weight plane can too (one table, not two)."""
    dtype = DTYPES[name]
    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tensor = source.to(dtype) if name != "float8_e8m0fnu" else torch.ones(2, 3).to(dtype)  # powers of 2 only
    closed = []
    planner = BucketPlanner(1024, closed.append)
    buffer = torch.zeros(1024, dtype=torch.uint8)
    planner.place("t", dtype, tuple(tensor.shape), lambda index, entry: write_full(buffer, entry, tensor))
    planner.finish()
    (bucket,) = closed
    (got_name, got), = list(BucketUnpacker().add(bucket.entries, buffer[: bucket.used_bytes]))
    assert got_name == "t" and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
