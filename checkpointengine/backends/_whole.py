"""Shared by ``broadcast`` and ``disk``: whole tensors (cast to the engine dtype, contiguous) grouped into
buckets of at most ``bucket_bytes`` (a larger tensor travels alone)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from checkpointengine.bucket import TensorEntry, dtype_name
from checkpointengine.naming import to_engine_dtype


def whole_buckets(sender, stream) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(engine_name, tensor)``; then checks that the update covers the engine
    (MissingWeightsError)."""
    bucket, used, sent = [], 0, []
    for name, tensor in stream:
        tensor = to_engine_dtype(tensor, sender.engine_dtype)
        if bucket and used + tensor.nbytes > sender.handle.bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += tensor.nbytes
        sent.append(name)
    sender.mapper.check_coverage(sent)
    if bucket:
        yield bucket


def whole_entries(bucket: list[tuple[str, torch.Tensor]]) -> list[TensorEntry]:
    """One unchunked entry per tensor (offsets are unused by whole-tensor backends)."""
    return [TensorEntry(n, dtype_name(t.dtype), tuple(t.shape), 0, t.nbytes, (0, t.nbytes)) for n, t in bucket]
