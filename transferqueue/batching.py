"""Turning variable-length fields of a ``Batch`` into the padded ``(batch, len)`` tensors trainers use."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence


def pad_sequences(seqs: list[torch.Tensor] | torch.Tensor, pad_value: float | int = 0, side: str = "right",
                  max_len: int | None = None) -> torch.Tensor:
    """Stack per-sample 1-D+ tensors ``(len_i, *rest)`` into ``(batch, max_len, *rest)``.

    ``side="right"`` pads after each sequence (responses), ``"left"`` before it (prompts; the sample
    schema, ``common/schema.py``). ``max_len`` (optional) pads further to a fixed length. An already-stacked
    tensor is returned as is (padded to ``max_len`` if given). Raises ValueError for an unknown side, an empty list, or a
    sequence longer than ``max_len``.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if isinstance(seqs, torch.Tensor):
        seqs = list(seqs)
    if not seqs:
        raise ValueError("pad_sequences needs at least one sequence")
    out = pad_sequence(seqs, batch_first=True, padding_value=pad_value, padding_side=side)
    if max_len is not None:
        if out.shape[1] > max_len:
            raise ValueError(f"a sequence of length {out.shape[1]} exceeds max_len={max_len}")
        extra = max_len - out.shape[1]
        if extra:
            pad = torch.full((out.shape[0], extra, *out.shape[2:]), pad_value, dtype=out.dtype)
            out = torch.cat([out, pad] if side == "right" else [pad, out], dim=1)
    return out
