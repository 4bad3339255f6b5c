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

# Fields a training step reads, with the side their padding goes on and the pad value.
PROMPT_SIDE = {schema.INPUT_IDS: 0, schema.ATTENTION_MASK: 0}
RESPONSE_SIDE = {schema.RESPONSES: 0, schema.RESPONSE_MASK: 0, schema.ROLLOUT_LOG_PROBS: 0.0,
                 schema.TOKEN_LEVEL_SCORES: 0.0}


def fetch_batch(client, meta: BatchMeta, extra_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """The training fields of ``meta``'s samples as padded tensors ``(batch, prompt_len)`` /
    ``(batch, response_len)`` plus ``uid`` (list of str). ``extra_fields``: more per-sample fields to
    fetch — the advantage estimator's ``roller_extras``, e.g. ``remax_baseline``, shape ``(batch,)``. Raises ValueError when a sample has no ``uid``
    tag; transport errors as ``TQClient.get_data``."""
    uids = [tag.get(schema.UID) for tag in meta.tags]
    if any(u is None for u in uids):
        raise ValueError(f"samples {meta.sample_ids} lack a {schema.UID!r} tag")
    names = list(PROMPT_SIDE) + list(RESPONSE_SIDE) + list(extra_fields)
    data = client.get_data(meta, names)
    out: dict[str, Any] = {schema.UID: [str(u) for u in uids]}
    for name, pad in PROMPT_SIDE.items():
        out[name] = pad_sequences(data[name], pad, side="left")
    for name, pad in RESPONSE_SIDE.items():
        out[name] = pad_sequences(data[name], pad, side="right")
    for name in extra_fields:
        value = data[name]
        out[name] = value if isinstance(value, torch.Tensor) else torch.stack(list(value))
    return out
