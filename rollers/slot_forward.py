"""The torch engine's forwards over its slots: one right-padded prefill of newcomers, one decode step of
every running slot.

Sequences keep their keys/values at their absolute positions in a per-slot cache
(``rollers.kv_cache.SlotKVCache``), so positions and masks of a sequence never depend on the slot's
history or its neighbours; greedy output equals Hugging Face ``generate`` token for token. Masks are 4-D
and additive (0 where a query may attend, the dtype's minimum elsewhere), in the model's dtype.
"""

from __future__ import annotations

import torch

from rollers.kv_cache import SlotKVCache


class SlotForward:
    """Forwards of ``model`` (on ``device``) over the slots of ``cache``. Counts the forwards
    (``num_forwards``), the token positions prefill forwards computed, padding included
    (``num_prefill_tokens``), and the prompt positions taken from a cached prefix instead
    (``num_reused_tokens``)."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, device: torch.device):
        self._model, self._cache, self._device = model, cache, device
        self.num_forwards = 0
        self.num_prefill_tokens = 0
        self.num_reused_tokens = 0

    def prefill(self, first: int, tokens: list[tuple[int, ...]], reused: list[int]) -> torch.Tensor:
        """One right-padded forward writing ``tokens`` (one sequence per row) into slots ``first ..``, each row
        from position ``reused[row]`` (the slot already holds the positions before it); returns the logits at
        each row's last position, (rows, vocab)."""
        num_rows = len(tokens)
        lengths = torch.tensor([len(t) - r for t, r in zip(tokens, reused, strict=True)], device=self._device)
        seq_len = int(lengths.max().item())
        input_ids = torch.zeros(num_rows, seq_len, dtype=torch.long, device=self._device)
        for row, (toks, r) in enumerate(zip(tokens, reused, strict=True)):
            input_ids[row, : len(toks) - r] = torch.tensor(toks[r:], device=self._device)
        positions = torch.arange(seq_len, device=self._device)
        last = lengths - 1
        keep = torch.unique(last)
        self.num_prefill_tokens += num_rows * seq_len
        self.num_reused_tokens += sum(reused)
        if not any(reused):
            allowed = (positions[None, :] <= positions[:, None])[None] & (positions < lengths[:, None])[:, None, :]
            self._cache.plan_prefill(first, num_rows, seq_len)
            logits = self._forward(input_ids, positions.expand(num_rows, -1), self._mask(allowed[:, None]), keep)
        else:  # queries at start + i attend to keys 0 .. start + i of their own row (reused prefix included)
            starts = torch.tensor(reused, device=self._device)[:, None]
            ends = starts + lengths[:, None]
            # A row's padding queries all sit one past its last token (inside the context length): the next
            # decode step overwrites what they write there.
            query_at = torch.where(positions[None, :] < lengths[:, None], starts + positions[None, :], ends)
            key_at = torch.arange(int(query_at.max().item()) + 1, device=self._device)
            allowed = (key_at[None, None, :] <= query_at[:, :, None]) & (key_at[None, None, :] < ends[:, :, None])
            self._cache.plan_prefill(first, num_rows, seq_len, query_at)
            logits = self._forward(input_ids, query_at, self._mask(allowed[:, None]), keep)
        return logits[torch.arange(num_rows, device=self._device), torch.searchsorted(keep, last)]

    def decode(self, last_tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One forward over slots ``0 .. len(last_tokens) - 1``: feed each slot's last token at its own
        position (``positions``: the tokens its cache holds); returns the logits, (rows, vocab)."""
        tokens = torch.tensor([[token] for token in last_tokens], device=self._device)
        at = torch.tensor(positions, device=self._device)
        self._cache.plan_decode(at)
        kv_len = int(at.max().item()) + 1
        allowed = torch.arange(kv_len, device=self._device)[None, :] <= at[:, None]
        return self._forward(tokens, at[:, None], self._mask(allowed[:, None, None]), 1)[:, -1]

    def _forward(self, input_ids, position_ids, mask, logits_to_keep) -> torch.Tensor:
        self.num_forwards += 1
        out = self._model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out.logits

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """Additive 4-D attention mask (0 where ``allowed``, dtype minimum elsewhere) in the model dtype."""
        dtype = next(self._model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=self._device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
