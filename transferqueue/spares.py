"""The spare shared-memory blocks a ``TQClient`` holds, one per storage unit at most.

A put into a same-node unit needs a block in the unit's shared memory. Asking for one (``alloc``) costs a
round trip, so each put may ask the unit to lease the client its *next* block in the reply; the next put
of a size that fits writes into it and needs one round trip. A lease is valid for half the unit's lease
time (the unit's clock started first); past it the unit takes the block back, and so may a unit short of
room (the write then finds the block gone).

While a put flow waits for the reply that brings a block, an ``Asked`` marker stands in the unit's slot, so
no other flow asks too, and only the flow that set a marker removes it.
"""

from __future__ import annotations

import threading
import time

SPARE_MAX_BYTES = 8 << 20  # a client keeps one leased spare block per unit for puts up to this size


class Asked(set):
    """The units one put flow asked a spare block of; the object itself marks them in ``SpareBlocks``
    until the reply brings the block."""


class SpareBlocks:
    """Unit -> ``(block name, size in bytes, valid until (monotonic s))`` or an ``Asked`` marker;
    thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spares: dict[int, tuple[str, int, float] | Asked] = {}

    def keep(self, unit: int, lease: dict) -> None:
        """Hold the block a unit's reply leased (``{"block", "size", "lease_s"}``) unless one is held or
        asked for already."""
        with self._lock:
            if unit not in self._spares:
                self._spares[unit] = (lease["block"], lease["size"], time.monotonic() + lease["lease_s"] / 2)

    def replace(self, unit: int, lease: dict) -> None:
        """Hold the block a put's reply brought in place of that put's ``Asked`` marker (no other flow's
        block can be there: the marker kept them from asking)."""
        with self._lock:
            self._spares.pop(unit, None)
        self.keep(unit, lease)

    def held(self, unit: int) -> str | None:
        """The name of the block held for ``unit`` (kept held), or None."""
        with self._lock:
            spare = self._spares.get(unit)
            return spare[0] if isinstance(spare, tuple) else None

    def take(self, unit: int, need: int) -> str | None:
        """The name of the block held for ``unit`` (no longer held) if it is still leased and has ``need``
        bytes, else None (a lapsed block is dropped: the unit takes it back)."""
        with self._lock:
            spare = self._spares.get(unit)
            if not isinstance(spare, tuple):
                return None
            name, size, valid_until = spare
            if time.monotonic() >= valid_until:
                del self._spares[unit]
                return None
            if size < need:
                return None
            del self._spares[unit]
            return name

    def ask(self, unit: int, nbytes: int, asked: Asked) -> bool:
        """Whether a put of ``nbytes`` to ``unit`` should ask for the next spare block: true (and
        ``asked`` marks the unit) when none is held or asked for and the put is small enough to keep one."""
        with self._lock:
            if nbytes > SPARE_MAX_BYTES or unit in self._spares:
                return False
            self._spares[unit] = asked
            asked.add(unit)
            return True

    def release(self, asked: Asked) -> None:
        """Remove the markers ``asked`` still holds (its flow ended without the blocks)."""
        with self._lock:
            for unit in asked:
                if self._spares.get(unit) is asked:
                    del self._spares[unit]
