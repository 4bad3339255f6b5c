"""Reading a trainer batch straight from the TransferQueue (the controller passes only metadata).

``fetch_batch(client, meta)`` turns a ``BatchMeta`` slice into the padded, batch-first dict the worker
stages take (``common/schema.py``): prompts left-padded, responses right-padded, ``uid`` from the
samples' tags. Variable-length fields (prompts fed in different calls, responses padded per group) are
padded here to the widest sample of the slice.
"""

from __future__ import annotations

from typing import Any

import torch

from common import schema
from transferqueue.batching import pad_sequences
from transferqueue.records import BatchMeta

# Fields a training step reads (common.schema.TRAINER), each padded with 0 on its ``pad_side``.
TRAIN_FIELDS = schema.TRAINER.read_fields()


def fetch_batch(client, meta: BatchMeta, extra_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """The training fields of ``meta``'s samples as padded tensors ``(batch, prompt_len)`` /
    ``(batch, response_len)`` plus ``uid`` (list of str). ``extra_fields``: more per-sample fields to
    fetch — the advantage estimator's ``roller_extras``, e.g. ``remax_baseline``, shape ``(batch,)``. Raises ValueError when a sample has no ``uid``
    tag; transport errors as ``TQClient.get_data``."""
    uids = [tag.get(schema.UID) for tag in meta.tags]
    if any(u is None for u in uids):
        raise ValueError(f"samples {meta.sample_ids} lack a {schema.UID!r} tag")
    data = client.get_data(meta, [*TRAIN_FIELDS, *extra_fields])
    out: dict[str, Any] = {schema.UID: [str(u) for u in uids]}
    for name in TRAIN_FIELDS:
        out[name] = pad_sequences(data[name], 0, side=schema.FIELDS[name].pad_side)
    for name in extra_fields:
        value = data[name]
        out[name] = value if isinstance(value, torch.Tensor) else torch.stack(list(value))
    return out
