"""A per-slot key/value cache for the torch engine's continuous batch.

Every layer holds two preallocated buffers ``(num_slots, num_kv_heads, capacity, head_dim)``. Slot ``s``
keeps the keys/values of its sequence at their absolute positions ``0 .. length_s - 1``, so a sequence's
positions never depend on what else is in the batch: there is no shared padding, only a per-row mask.
The engine keeps the running sequences in the slot prefix ``0 .. batch - 1`` (``move`` compacts it when
one leaves), so a decode step attends over the view ``[:batch, :, :kv_len]`` without gathering.

Before each forward the engine states what the forward writes (``plan_prefill`` / ``plan_decode``); the
model's attention layers then call ``update`` once per layer, as with any transformers ``Cache``. A prefill
may write each row at its own positions (``positions``): the row's earlier positions already hold a reused prefix
(the engine's prefix reuse), and attention then runs over the cache, prefix included.
Capacity grows by doubling (``reserve``), so memory follows the longest live sequence, not the model's
maximum context.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    """Preallocated per-slot KV cache (see the module docstring).

    ``num_slots``: rows of the continuous batch. Buffers are created on the first ``update`` of each
    layer (their head count, head size, dtype and device come from the model's key states).
    """

    def __init__(self, num_slots: int, initial_capacity: int = 128, max_capacity: int | None = None):
        super().__init__(layers=[])
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.capacity = max(1, initial_capacity)
        self.max_capacity = max_capacity
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self._rows = slice(0, 0)
        self._positions: torch.Tensor | None = None
        self._write_at: torch.Tensor | None = None
        self._kv_len = 0

    # ------------------------------------------------------------------------------- engine side

    def reserve(self, length: int) -> None:
        """Make every layer hold at least ``length`` positions per slot (doubling up to ``max_capacity``,
        contents kept). Raises ValueError past ``max_capacity``."""
        if length <= self.capacity:
            return
        if self.max_capacity is not None and length > self.max_capacity:
            raise ValueError(f"KV cache length {length} exceeds max_capacity={self.max_capacity}")
        new_capacity = self.capacity
        while new_capacity < length:
            new_capacity *= 2
        if self.max_capacity is not None:
            new_capacity = min(new_capacity, self.max_capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                if old is None:
                    continue
                grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
                grown[:, :, : old.shape[2]] = old
                buffers[i] = grown
        self.capacity = new_capacity

    def plan_prefill(self, first_row: int, num_rows: int, seq_len: int, positions: torch.Tensor | None = None
                     ) -> None:
        """The next forward writes ``seq_len`` positions of rows ``first_row .. +num_rows``: ``0 .. seq_len - 1``,
        or ``positions`` ``(num_rows, seq_len)`` long (each row's positions before them are kept: a reused
        prefix), and attention then runs over positions ``0 .. positions.max()`` of the cache."""
        self._rows = slice(first_row, first_row + num_rows)
        self._positions = None
        self._write_at = positions
        self._kv_len = seq_len if positions is None else int(positions.max().item()) + 1
        self.reserve(self._kv_len)

    def plan_decode(self, positions: torch.Tensor) -> None:
        """The next forward writes one position per row ``0 .. batch - 1``; ``positions`` (batch,) long."""
        kv_len = int(positions.max().item()) + 1
        self.reserve(kv_len)
        self._rows = slice(0, positions.shape[0])
        self._positions = positions
        self._write_at = None
        self._kv_len = kv_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (every layer)."""
        for buffers in (self.keys, self.values):
            for buf in buffers:
                if buf is not None:
                    buf[dst, :, :length] = buf[src, :, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` positions of slots ``a`` and ``b`` (every layer)."""
        if a == b:
            return
        for buffers in (self.keys, self.values):
            for buf in buffers:
                if buf is not None:
                    held = buf[a, :, :length].clone()
                    buf[a, :, :length] = buf[b, :, :length]
                    buf[b, :, :length] = held

    def copy_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slots ``src[i]`` into slots ``dst[i]`` (every layer, one
        indexed copy per buffer). ``dst`` must not overlap ``src``."""
        src_idx, dst_idx = torch.tensor(src), torch.tensor(dst)
        for buffers in (self.keys, self.values):
            for buf in buffers:
                if buf is not None:
                    buf[dst_idx.to(buf.device), :, :length] = buf[src_idx.to(buf.device), :, :length]

    def clear(self) -> None:
        """Free every buffer (they are recreated, empty, by the next forward)."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)

    # -------------------------------------------------------------------------------- model side

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this forward's ``(rows, kv_heads, q_len, head_dim)`` keys/values for ``layer_idx`` and
        return the keys/values to attend over, ``(rows, kv_heads, kv_len, head_dim)``."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None:
            shape = (self.num_slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = self._rows
        if self._positions is None and self._write_at is None:  # prefill from 0: attend over what was written
            q_len = key_states.shape[2]
            keys[rows, :, :q_len] = key_states
            values[rows, :, :q_len] = value_states
            return key_states, value_states
        if self._positions is None:  # prefill after a reused prefix: each row from its own start
            row_idx = torch.arange(rows.start, rows.stop, device=keys.device)[:, None]
            at = self._write_at.to(keys.device)
            keys[row_idx, :, at] = key_states.transpose(1, 2)
            values[row_idx, :, at] = value_states.transpose(1, 2)
            return keys[rows, :, : self._kv_len], values[rows, :, : self._kv_len]
        row_idx = torch.arange(rows.start, rows.stop, device=keys.device)
        keys[row_idx, :, self._positions] = key_states[:, :, 0]
        values[row_idx, :, self._positions] = value_states[:, :, 0]
        return keys[rows, :, : self._kv_len], values[rows, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._kv_len, 0
