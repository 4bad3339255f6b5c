"""Prefix reuse in the torch engine's free slots (what SGLang's radix cache gives multi-turn rollouts).

A finished request leaves its keys/values in its slot, which is free again; a newcomer that continues it —
its token ids start with every token the slot holds, as the next turn of an agent loop
(``rollers.agent_loop``) does — takes that slot and prefills only its new tokens. Free slots hold at most
``max_batch_slots - running`` such prefixes; one in a newcomer's way moves to an empty free slot, else to
an older prefix's (evicting it), else is dropped. Requests cut by a pause are not kept (a weight load
follows). Reused keys/values were computed token by token while decoding, so logits match a full prefill to
float rounding (~1e-6), not bit for bit. A weight load or ``flush_cache`` drops every prefix (they belong to
the old weights). Only exact continuations are reused: no shared-prefix tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollers.kv_cache import SlotKVCache


@dataclass(frozen=True)
class _Prefix:
    """A finished request's keys/values left in a free slot: ``tokens`` (those whose keys/values the slot
    holds, positions ``0 .. len - 1``) and ``stamp`` (finish order: the smallest is evicted first)."""

    tokens: tuple[int, ...]
    stamp: int


class SlotPrefixes:
    """The prefixes held by the free slots of ``cache`` (``num_slots`` slots), by slot. The engine says
    which slot a finished request left (``keep``) and asks where its newcomers go (``place``); the keys and
    values move in ``cache`` with their records."""

    def __init__(self, cache: SlotKVCache, num_slots: int):
        self._cache = cache
        self._prefixes: list[_Prefix | None] = [None] * num_slots  # by slot; only free slots hold one
        self._num_kept = 0  # prefixes kept so far: the next one's stamp

    @property
    def num_cached(self) -> int:
        """Free slots holding a prefix."""
        return sum(p is not None for p in self._prefixes)

    def keep(self, slot: int, tokens: tuple[int, ...]) -> None:
        """A finished request's keys/values stay in ``slot``, free now: ``tokens`` are those the slot holds
        (positions ``0 .. len - 1``)."""
        self._num_kept += 1
        self._prefixes[slot] = _Prefix(tokens, self._num_kept)

    def clear(self) -> None:
        """Forget every prefix (new weights, a flushed cache, a failed engine)."""
        self._prefixes = [None] * len(self._prefixes)

    def _swap(self, a: int, b: int) -> None:
        """Exchange two free slots' prefixes (keys/values and records)."""
        pa, pb = self._prefixes[a], self._prefixes[b]
        self._cache.swap(a, b, max(len(pa.tokens) if pa else 0, len(pb.tokens) if pb else 0))
        self._prefixes[a], self._prefixes[b] = pb, pa

    def place(self, first: int, keys: list[tuple[int, ...]], num_new: int) -> list[int]:
        """Get slots ``first .. first + num_new - 1`` ready for the newcomers (``keys``: the distinct token ids
        prefilled into slots ``first ..``, in order; duplicates follow). A key that continues a cached prefix
        gets that prefix's slot swapped into place; a prefix in the way of any other newcomer moves to an empty
        free slot above them, or to that of an older prefix (evicting it), or is dropped. Returns, per key, the
        positions already held (reused)."""
        num_slots = len(self._prefixes)
        reused = [0] * len(keys)
        claimed: dict[int, int] = {}  # key index -> slot of the prefix it continues
        for k, key in enumerate(keys):
            best = None
            for slot in range(first, num_slots):
                p = self._prefixes[slot]
                if p is None or slot in claimed.values() or len(p.tokens) >= len(key) \
                        or key[: len(p.tokens)] != p.tokens:
                    continue
                if best is None or len(p.tokens) > len(self._prefixes[best].tokens):
                    best = slot
            if best is not None:
                claimed[k] = best
        for k, slot in claimed.items():
            target = first + k
            if slot != target:
                self._swap(slot, target)
                for other, other_slot in claimed.items():  # the prefix that sat at target now sits at slot
                    if other_slot == target:
                        claimed[other] = slot
                claimed[k] = target
            reused[k] = len(self._prefixes[target].tokens)
        above = range(first + num_new, num_slots)
        for target in range(first, first + num_new):
            p, self._prefixes[target] = self._prefixes[target], None
            if p is None or claimed.get(target - first) == target:
                continue
            empty = next((s for s in above if self._prefixes[s] is None), None)
            oldest = min(above, key=lambda s: self._prefixes[s].stamp, default=None) if empty is None else None
            dest = empty if empty is not None else (
                oldest if oldest is not None and self._prefixes[oldest].stamp < p.stamp else None)
            if dest is not None:
                self._cache.move(target, dest, len(p.tokens))
                self._prefixes[dest] = p
        return reused
