"""Fresh sample ids reserved by clients: ranges of ids a client creates samples with at ``notify`` without a
round trip to the index per put, bounded per request, per client and in all, and lapsing after a lease.

::

    reserve(start, count, owner) -> range [start, start+count): one byte per id (0 free, 1 used),
                                    charged to ``owner`` until used up or lapsed
    claim(ids)                   -> mark ids used (a put's notify); a used-up range is forgotten
    expire(now)                  -> forget ranges whose lease ended (their clients went away, or moved on)

A client is a connection to the index (its ZMQ identity): the index cannot tell the connections of one
process apart, so each holds its own share of ``max_client_reserved_ids``; ``max_reserved_ids`` bounds
them all. Ids are never reused, so a lapsed range's unused ids are simply never handed out.
"""

from __future__ import annotations

import bisect
import time

from transferqueue.config import TransferQueueConfig
from transferqueue.records import LimitExceeded
from transferqueue.wire import check_id_count, id_range

MIN_CHARGE = 64  # ids a reservation counts against the bounds at least (its bookkeeping)


class Reservations:
    """The reserved ranges of the index. ``limits``: the config whose ``max_request_ids``,
    ``max_client_reserved_ids``, ``max_reserved_ids`` and ``reservation_lease_s`` apply."""

    def __init__(self, limits: TransferQueueConfig):
        self.limits = limits
        self.used: dict[int, bytearray] = {}  # start -> one byte per id: 0 free, 1 used
        self.starts: list[int] = []  # in reservation order: also the order of expiry
        self.leases: dict[int, tuple[float, bytes, int]] = {}  # start -> (expires at, owner, ids charged)
        self.by_owner: dict[bytes, int] = {}  # ids charged per client connection
        self.total = 0  # ids charged in all

    def reserve(self, start: int, count: int, owner: bytes) -> None:
        """Reserve ids ``[start, start + count)`` (``start`` past every id handed out so far) for ``owner``
        until ``reservation_lease_s`` from now. Raises ValueError, reserving nothing, for ``count < 1``, and
        LimitExceeded (a ValueError) for a request past ``max_request_ids``, ``max_client_reserved_ids`` or
        ``max_reserved_ids`` (each names the bound and its value); a reservation counts as at least ``MIN_CHARGE`` ids."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"reserve count must be a positive int, got {count!r}")
        lim, charge = self.limits, max(count, MIN_CHARGE)
        check_id_count("reserve", count, lim.max_request_ids)
        held = self.by_owner.get(owner, 0)
        if held + charge > lim.max_client_reserved_ids:
            raise LimitExceeded("max_client_reserved_ids", f"reserve: this client holds {held} reserved ids; "
                                f"{charge} more would pass transferqueue.max_client_reserved_ids="
                                f"{lim.max_client_reserved_ids}")
        if self.total + charge > lim.max_reserved_ids:
            raise LimitExceeded("max_reserved_ids", f"reserve: clients hold {self.total} reserved ids; {charge} more "
                                f"would pass transferqueue.max_reserved_ids={lim.max_reserved_ids}")
        self.used[start] = bytearray(count)
        self.starts.append(start)
        self.leases[start] = (time.monotonic() + lim.reservation_lease_s, owner, charge)
        self.by_owner[owner] = held + charge
        self.total += charge

    def _end(self, start: int) -> None:
        """Forget range ``start`` (used up or lapsed; the caller updates ``starts``): its charge goes back."""
        del self.used[start]
        _, owner, charge = self.leases.pop(start)
        self.total -= charge
        left = self.by_owner[owner] - charge
        if left:
            self.by_owner[owner] = left
        else:
            del self.by_owner[owner]

    def expire(self, now: float | None = None) -> int:
        """Forget the ranges whose lease ended by ``now`` (monotonic; default: now); returns how many. A
        notify naming one of their unused ids is refused. Ranges end in the order they were made, so this
        costs O(expired)."""
        now = time.monotonic() if now is None else now
        starts = self.starts
        k = 0
        while k < len(starts) and self.leases[starts[k]][0] <= now:
            self._end(starts[k])
            k += 1
        del starts[:k]
        return k

    def claim(self, sample_ids: list[int]) -> None:
        """Mark reserved ids used; ValueError (nothing marked) if one was not reserved, is used or cleared,
        or its range lapsed.

        The usual put claims ids ``a, a+1, ..., a+n-1`` inside one reserved range: that costs one bisect,
        one list comparison and a byte-slice search. Anything else (ids spanning ranges, out of order,
        not plain ints, a used or unreserved id) takes the per-id path, which also picks the error."""
        n = len(sample_ids)
        first = sample_ids[0] if n else None
        i = bisect.bisect_right(self.starts, first) - 1 if isinstance(first, int) else -1
        if i >= 0:
            start = self.starts[i]
            used, off = self.used[start], first - start
            if off + n <= len(used) and used.find(1, off, off + n) < 0 and id_range(sample_ids) == first:
                used[off:off + n] = b"\x01" * n
                if 0 not in used:
                    self._end(start)
                    del self.starts[i]
                return
        self._claim_each(sample_ids)

    def _claim_each(self, sample_ids: list[int]) -> None:
        slots = []
        for sid in sample_ids:
            i = bisect.bisect_right(self.starts, sid) - 1 if isinstance(sid, int) else -1
            start = self.starts[i] if i >= 0 else None
            used = self.used.get(start) if start is not None else None
            if used is None or sid - start >= len(used) or used[sid - start]:
                raise ValueError(f"sample id {sid!r} was not reserved, or was already used or cleared, or "
                                 f"its reservation lapsed (transferqueue.reservation_lease_s="
                                 f"{self.limits.reservation_lease_s})")
            slots.append((start, sid - start))
        if len(set(slots)) != len(slots):
            raise ValueError("sample_ids contain duplicates")
        for start, off in slots:
            self.used[start][off] = 1
        done = {start for start, _ in slots if 0 not in self.used[start]}
        for start in done:
            self._end(start)
        if done:
            self.starts = [s for s in self.starts if s not in done]
