"""A storage unit's table of stored rows: per field, chunks of consecutive sample ids pointing into buffers.

A put of ids ``[lo, hi)`` (the common case: a client's fresh ids) becomes one chunk per field; rows of a
fixed-shape column are found by arithmetic (``base + row * i``), so a put or get of such a range costs a
few dozen Python operations per field whatever its size. Other puts (scattered ids, variable shapes,
one frame per sample) keep per-row offset arrays.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from transferqueue import wire


@dataclass
class Holder:
    """One received buffer set (a shm block or the frames of one put) and the chunks that use it."""

    nbytes: int
    block: object | None = None  # a storage.ShmBlock
    frames: list = field(default_factory=list)
    refs: int = 0


@dataclass
class Chunk:
    """Rows ``[start, start + count)`` of one field.

    Packed fixed-size rows (``off`` None): row ``i`` is ``bufs[0][base + i*row : base + (i+1)*row]``.
    Otherwise row ``i`` is ``bufs[buf_of_row[i]][off[i]:off[i]+nb[i]]`` (``buf_of_row`` None: ``bufs[0]``).
    ``shape``: every row's shape when the column was put with one fixed shape (``shapes`` None), else None
    and ``shapes`` holds one shape per row. ``alive`` None: no row cleared yet.
    """

    start: int
    count: int
    dtype: str
    shape: list[int] | None
    shapes: list[list[int]] | None
    holder: Holder
    bufs: list
    buf_of_row: np.ndarray | None = None
    base: int = 0
    row: int = 0
    off: np.ndarray | None = None
    nb: np.ndarray | None = None
    alive: np.ndarray | None = None
    nalive: int = 0

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of rows ``[r0, r1)`` inside ``bufs[0]`` (``buf_of_row`` must be None)."""
        if self.off is None:
            return self.base + r0 * self.row, (r1 - r0) * self.row
        return int(self.off[r0]), int(self.off[r1 - 1] + self.nb[r1 - 1] - self.off[r0])

    def pieces(self, r0: int, r1: int) -> list[tuple[object, int, int]]:
        """``(buffer, offset, nbytes)`` covering rows ``[r0, r1)`` in order."""
        if self.buf_of_row is None:
            return [(self.bufs[0], *self.span(r0, r1))]
        return [(self.bufs[int(self.buf_of_row[r])], int(self.off[r]), int(self.nb[r])) for r in range(r0, r1)]

    def all_alive(self, r0: int, r1: int) -> bool:
        return self.alive is None or bool(self.alive[r0:r1].all())

    def kill(self, rows: np.ndarray | slice) -> int:
        """Mark ``rows`` cleared; returns how many of them were alive."""
        if self.alive is None:
            self.alive = np.ones(self.count, dtype=bool)
        killed = int(self.alive[rows].sum())
        self.alive[rows] = False
        self.nalive -= killed
        return killed


def chunks_of_column(col: dict, ids: np.ndarray, runs: list[tuple[int, int]], holder: Holder, bufs: list,
                     buf_of_row: np.ndarray | None, off: int | np.ndarray) -> list[Chunk]:
    """One chunk per run ``(position, length)`` of consecutive ids of a validated column. ``off``: the
    column's base offset in ``bufs[0]`` (packed) or per-row offsets (one buffer per row)."""
    fixed_row = col["nbytes"] // max(col["count"], 1) if "shape" in col and buf_of_row is None else None
    shapes = col.get("shapes")
    out = []
    if fixed_row is not None and isinstance(off, int):
        for pos, length in runs:
            out.append(Chunk(int(ids[pos]), length, col["dtype"], col["shape"], None, holder, bufs,
                             base=off + pos * fixed_row, row=fixed_row, nalive=length))
        return out
    nb = _row_nbytes(col)
    if isinstance(off, int):
        off = off + _row_offsets(col, nb)
    for pos, length in runs:
        sl = slice(pos, pos + length)
        out.append(Chunk(int(ids[pos]), length, col["dtype"], col.get("shape"),
                         None if shapes is None else shapes[sl], holder, bufs,
                         None if buf_of_row is None else buf_of_row[sl], off=off[sl], nb=nb[sl], nalive=length))
    return out


def _row_nbytes(col: dict) -> np.ndarray:
    if "shape" in col:
        return np.full(col["count"], col["nbytes"] // max(col["count"], 1), dtype=np.int64)
    return np.asarray(wire.row_nbytes(col), dtype=np.int64)


def _row_offsets(col: dict, nb: np.ndarray) -> np.ndarray:
    """Byte offset of each sample inside a packed column whose rows have sizes ``nb``."""
    return np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64) if len(nb) else nb


class FieldTable:
    """Chunks of one field sorted by start id (they never overlap): ``bisect`` for one range, a
    vectorised ``locate`` for scattered ids."""

    def __init__(self):
        self.chunks: list[Chunk] = []
        self.starts: list[int] = []
        self._np: tuple[np.ndarray, np.ndarray] | None = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._np is None:
            starts = np.array(self.starts, dtype=np.int64)
            self._np = (starts, starts + np.array([c.count for c in self.chunks], dtype=np.int64))
        return self._np

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(chunk index, row, found)`` per id; ``found`` False where no chunk covers the id."""
        starts, ends = self._arrays()
        if not len(starts):
            zeros = np.zeros(len(ids), dtype=np.int64)
            return zeros, zeros, np.zeros(len(ids), dtype=bool)
        cidx = np.searchsorted(starts, ids, side="right") - 1
        safe = np.maximum(cidx, 0)
        found = (cidx >= 0) & (ids < ends[safe])
        return safe, ids - starts[safe], found

    def covering(self, lo: int, hi: int) -> Chunk | None:
        """The chunk holding all of ids ``[lo, hi)``, or None (several chunks, or some ids missing)."""
        i = bisect.bisect_right(self.starts, lo) - 1
        if i < 0:
            return None
        ch = self.chunks[i]
        return ch if hi <= ch.start + ch.count else None

    def overlapping(self, lo: int, hi: int) -> list[Chunk]:
        """The chunks holding some id in ``[lo, hi)``, in order."""
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        j = bisect.bisect_left(self.starts, hi)
        return [c for c in self.chunks[i:j] if c.start + c.count > lo]

    def insert(self, chunk: Chunk) -> None:
        i = bisect.bisect_left(self.starts, chunk.start)
        self.starts.insert(i, chunk.start)
        self.chunks.insert(i, chunk)
        self._np = None

    def drop_dead(self) -> list[Chunk]:
        dead = [c for c in self.chunks if c.nalive == 0]
        if dead:
            self.chunks = [c for c in self.chunks if c.nalive]
            self.starts = [c.start for c in self.chunks]
            self._np = None
        return dead


def contiguous_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """``(position, length)`` of the maximal runs of consecutive ids in ``ids``."""
    if not len(ids):
        return []
    brk = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = [0, *brk.tolist()]
    ends = [*brk.tolist(), len(ids)]
    return [(s, e - s) for s, e in zip(starts, ends, strict=True)]
