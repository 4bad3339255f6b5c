"""Storage unit: holds tensor bytes exactly as received, keyed by (field, sample id). One process each.

::

    same node:    client --alloc(nbytes)--> unit: block "hflow-tq-…" from its shared-memory pool
                  client memcpy -> /dev/shm block;  client --put(ids, columns, block offsets)--> unit
                  client --get(ids, fields)--> unit: [(block, offset, nbytes), ...] ; client memcpy out
    across nodes: client --put(header, frame per column)--> unit keeps the received zmq frames
                  client --get--> unit sends (zero-copy) slices of its blocks / frames

A column chunk covers one contiguous run of sample ids of one field and points into a buffer (shared
memory block or received frame); buffers are reference counted by the chunks that use them. Capacity
counts every live or pooled buffer; a put that does not fit gets a ``full`` error reply (the client
retries until its timeout, then raises ``Full``), so memory never grows without bound. Shared-memory
blocks are recycled through size-class free lists, so steady-state puts write into pre-faulted pages.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from transferqueue import wire
from transferqueue.records import CurveKeys
from transferqueue.server import Reply, RouterServer

SHM_DIR = "/dev/shm"
ALIGN = 64


class FullError(ValueError):
    """Capacity exceeded (sent to the client as ``full``)."""

    full = True


class ShmBlock:
    """A POSIX shared-memory segment (a file under /dev/shm), mapped and pre-faulted by its creator."""

    def __init__(self, size: int):
        self.name = f"hflow-tq-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.size = size
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.view = np.frombuffer(self.mm, dtype=np.uint8)

    def destroy(self) -> None:
        self.view = None
        try:
            self.mm.close()
        except BufferError:  # a zero-copy send still references it; the mapping dies with the last ref
            pass
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def size_class(nbytes: int) -> int:
    """Block size for ``nbytes``: rounded up to 1/8 of its power of two (<= 12.5% waste), min 64 KiB."""
    n = max(nbytes, 64 * 1024)
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


@dataclass
class Holder:
    """One received buffer set (a shm block or the frames of one put) and the chunks that use it."""

    nbytes: int
    block: ShmBlock | None = None
    frames: list = field(default_factory=list)
    refs: int = 0


@dataclass
class Chunk:
    """Rows ``[start, start + count)`` of one field. Row ``i`` is ``bufs[buf_of_row[i]][off[i]:off[i]+nb[i]]``
    (``buf_of_row`` None: all rows in ``bufs[0]``)."""

    start: int
    count: int
    dtype: str
    shapes: list[list[int]]
    holder: Holder
    bufs: list
    buf_of_row: np.ndarray | None
    off: np.ndarray
    nb: np.ndarray
    alive: np.ndarray
    nalive: int


class FieldTable:
    """Chunks of one field sorted by start id, looked up with ``np.searchsorted``."""

    def __init__(self):
        self.chunks: list[Chunk] = []
        self._starts: np.ndarray | None = None
        self._ends: np.ndarray | None = None

    def _arrays(self):
        if self._starts is None:
            self._starts = np.array([c.start for c in self.chunks], dtype=np.int64)
            self._ends = self._starts + np.array([c.count for c in self.chunks], dtype=np.int64)
        return self._starts, self._ends

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

    def insert(self, chunk: Chunk) -> None:
        pos = int(np.searchsorted(self._arrays()[0], chunk.start))
        self.chunks.insert(pos, chunk)
        self._starts = None

    def drop_dead(self) -> list[Chunk]:
        dead = [c for c in self.chunks if c.nalive == 0]
        if dead:
            self.chunks = [c for c in self.chunks if c.nalive]
            self._starts = None
        return dead


def contiguous_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """``(position, length)`` of the maximal runs of consecutive ids in ``ids``."""
    if not len(ids):
        return []
    brk = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = [0, *brk.tolist()]
    ends = [*brk.tolist(), len(ids)]
    return [(s, e - s) for s, e in zip(starts, ends, strict=True)]


def _row_nbytes(col: dict) -> np.ndarray:
    if "shape" in col:
        return np.full(col["count"], col["nbytes"] // max(col["count"], 1), dtype=np.int64)
    return np.asarray(wire.row_nbytes(col), dtype=np.int64)


def _row_offsets(col: dict) -> np.ndarray:
    """Byte offset of each sample inside a packed column."""
    if "shape" in col:
        return np.arange(col["count"], dtype=np.int64) * (col["nbytes"] // max(col["count"], 1))
    nb = _row_nbytes(col)
    return np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64) if len(nb) else nb


def _as_ids(value, what: str = "ids") -> np.ndarray:
    if not isinstance(value, list):
        raise wire.WireError(f"{what} must be a list of non-negative ints")
    arr = np.asarray(value) if value else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (len(arr) and arr.min() < 0):
        raise wire.WireError(f"{what} must be a list of non-negative ints")
    return arr.astype(np.int64, copy=False)


class StorageUnit(RouterServer):
    """Serves ``alloc``, ``put``, ``get``, ``clear``, ``stats`` and ``ping``; everything else is rejected."""

    def __init__(self, address: str, capacity_bytes: int, curve: CurveKeys | None = None,
                 lease_s: float = 60.0, p2p: dict | None = None):
        super().__init__(address, curve)
        self.p2p = None
        if p2p:
            from transferqueue.p2p import UnitP2P

            host = address.split("//")[-1].rsplit(":", 1)[0] if address.startswith("tcp://") else "127.0.0.1"
            self.p2p = UnitP2P(p2p["backend"], p2p.get("device", "cpu"), host, lease_s)
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self.tables: dict[str, FieldTable] = {}
        self.used_bytes = 0  # live holders + pending allocations + pooled blocks
        self.free: dict[int, list[ShmBlock]] = {}
        self.pending: dict[str, tuple[ShmBlock, float]] = {}
        self.stored_bytes = 0
        self._received = False  # a p2p put's bytes were taken off the link (no drain on failure)

    # ----------------------------------------------------------------------------------- capacity
    def _reserve(self, nbytes: int) -> None:
        while self.used_bytes + nbytes > self.capacity_bytes and self.free:
            size = max(self.free)
            self.free[size].pop().destroy()
            self.used_bytes -= size
            if not self.free[size]:
                del self.free[size]
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise FullError(f"storage unit full: {self.used_bytes} of {self.capacity_bytes} bytes used, "
                            f"{nbytes} more requested")
        self.used_bytes += nbytes

    def _release(self, holder: Holder) -> None:
        holder.refs -= 1
        if holder.refs:
            return
        self.stored_bytes -= holder.nbytes
        if holder.block is not None:
            self.free.setdefault(holder.block.size, []).append(holder.block)  # stays counted in used_bytes
        else:
            self.used_bytes -= holder.nbytes
            holder.frames.clear()

    def tick(self) -> None:
        if self.p2p is not None:
            self.p2p.poll()
        now = time.monotonic()
        for name in [n for n, (_, deadline) in self.pending.items() if deadline < now]:
            block, _ = self.pending.pop(name)
            self.free.setdefault(block.size, []).append(block)

    # ------------------------------------------------------------------------------------- handle
    def handle(self, identity: bytes, header: dict, frames: list) -> Reply | None:
        op = header["op"]
        if op == "put":
            return self._put(header, frames)
        if op == "get":
            return self._get(header)
        if op == "alloc":
            return self._alloc(header)
        if op == "clear":
            return self._clear(header)
        if op == "stats":
            return {"used_bytes": self.used_bytes, "stored_bytes": self.stored_bytes,
                    "capacity_bytes": self.capacity_bytes, "fields": len(self.tables),
                    "chunks": sum(len(t.chunks) for t in self.tables.values()), "requests": self.requests}, []
        if op == "ping":
            return {}, []
        if op == "p2p_connect":
            if self.p2p is None:
                raise ValueError("this storage unit has no p2p device path (transferqueue.p2p_backend)")
            from transferqueue.server import node_id

            reply, self.after_reply = self.p2p.connect(header, node_id())
            return reply, []
        raise wire.WireError(f"unknown op {op!r} for a storage unit")

    def _alloc(self, header: dict) -> Reply:
        nbytes = header.get("nbytes")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise wire.WireError(f"alloc: nbytes must be a non-negative int, got {nbytes!r}")
        size = size_class(nbytes)
        pool = self.free.get(size)
        if pool:
            block = pool.pop()
            if not pool:
                del self.free[size]
        else:
            self._reserve(size)
            block = ShmBlock(size)
        self.pending[block.name] = (block, time.monotonic() + self.lease_s)
        return {"block": block.name, "size": block.size}, []

    def _put(self, header: dict, frames: list) -> Reply:
        ids = _as_ids(header.get("ids"))
        cols = header.get("columns")
        if not isinstance(cols, list) or not cols:
            raise wire.WireError("put: columns must be a non-empty list")
        cols = [wire.validate_column(c, len(ids)) for c in cols]
        if len({c["name"] for c in cols}) != len(cols):
            raise wire.WireError("put: duplicate column names")
        if len(set(ids.tolist())) != len(ids):
            raise wire.WireError("put: duplicate ids")
        link = header.get("p2p")
        self._received = False
        try:
            for c in cols:
                table = self.tables.get(c["name"])
                if table is not None and table.locate(ids)[2].any():
                    raise ValueError(f"put: field {c['name']!r} already stored for some of these ids")
            shm = header.get("shm")
            if link is not None:
                holder, placed = self._p2p_placement(cols, link, frames)
            elif shm is None:
                wire.validate_frames(cols, frames)
                holder = self._frames_holder(cols, frames)
                placed = self._place_frames(cols, frames)
            else:
                if frames:
                    raise wire.WireError("put: a shared-memory put carries no data frames")
                holder, placed = self._shm_placement(cols, shm)
        except Exception:
            if link is not None and self.p2p is not None and not self._received:
                self.p2p.drain(link, [c["nbytes"] for c in cols])  # the client is sending: consume it
            raise
        runs = contiguous_runs(ids)
        for c, (bufs, buf_of_row, off) in zip(cols, placed, strict=True):
            nb = _row_nbytes(c)
            shapes = c["shapes"] if "shapes" in c else [c["shape"]] * len(ids)
            table = self.tables.setdefault(c["name"], FieldTable())
            for pos, length in runs:
                sl = slice(pos, pos + length)
                table.insert(Chunk(int(ids[pos]), length, c["dtype"], shapes[sl], holder, bufs,
                                   None if buf_of_row is None else buf_of_row[sl], off[sl], nb[sl],
                                   np.ones(length, dtype=bool), length))
                holder.refs += 1
        if holder.refs == 0:  # zero samples
            holder.refs = 1
            self._release(holder)
        return {"nbytes": holder.nbytes}, []

    def _frames_holder(self, cols: list[dict], frames: list) -> Holder:
        nbytes = sum(c["nbytes"] for c in cols)
        self._reserve(nbytes)
        self.stored_bytes += nbytes
        return Holder(nbytes, frames=list(frames))

    def _place_frames(self, cols: list[dict], frames: list) -> list:
        placed, pos = [], 0
        for c in cols:
            if c["split"]:
                bufs = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames[pos:pos + c["count"]]]
                placed.append((bufs, np.arange(c["count"]), np.zeros(c["count"], dtype=np.int64)))
                pos += c["count"]
            else:
                placed.append(([np.frombuffer(frames[pos].buffer, dtype=np.uint8)], None, _row_offsets(c)))
                pos += 1
        return placed

    def _p2p_placement(self, cols: list[dict], link, frames: list) -> tuple[Holder, list]:
        if self.p2p is None:
            raise ValueError("this storage unit has no p2p device path")
        if frames or any(c["dtype"] == wire.OBJECT_DTYPE or c["split"] for c in cols):
            raise wire.WireError("put: a p2p put carries packed tensor columns only, no frames")
        nbytes = sum(c["nbytes"] for c in cols)
        self._reserve(nbytes)
        self._received = True  # from here on, a failure must not drain again
        try:
            bufs = self.p2p.receive(link, [c["nbytes"] for c in cols])
        except BaseException:
            self.used_bytes -= nbytes
            raise
        self.stored_bytes += nbytes
        placed = []
        for c, buf in zip(cols, bufs, strict=True):
            placed.append(([buf], None, _row_offsets(c)))
        return Holder(nbytes, frames=bufs), placed

    def _shm_placement(self, cols: list[dict], shm) -> tuple[Holder, list]:
        if not isinstance(shm, dict) or shm.get("block") not in self.pending:
            raise wire.WireError("put: shm.block must name a block allocated to this client and not yet used")
        offsets = shm.get("offsets")
        if not isinstance(offsets, list) or len(offsets) != len(cols) or not all(isinstance(o, int) for o in offsets):
            raise wire.WireError("put: shm.offsets must hold one int offset per column")
        block, _ = self.pending[shm["block"]]
        end = 0
        for c, o in zip(cols, offsets, strict=True):
            if c["split"] or o < end or o + c["nbytes"] > block.size:
                raise wire.WireError(f"put: column {c['name']!r} at offset {o} overlaps or leaves the block")
            end = o + c["nbytes"]
        del self.pending[shm["block"]]
        holder = Holder(block.size, block=block)
        self.stored_bytes += block.size
        placed = []
        for c, o in zip(cols, offsets, strict=True):
            placed.append(([block], None, o + _row_offsets(c)))
        return holder, placed

    def _get(self, header: dict) -> Reply:
        ids = _as_ids(header.get("ids"))
        names = header.get("fields")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise wire.WireError("get: fields must be a non-empty list of names")
        use_shm = bool(header.get("shm"))
        link = header.get("p2p")
        if link is not None and self.p2p is None:
            raise ValueError("get: this storage unit has no p2p device path")
        out_cols, frames, sends = [], [], ([] if link is not None else None)
        for name in names:
            table = self.tables.get(name)
            if table is None:
                raise ValueError(f"get: field {name!r} is not stored on this unit")
            cidx, rows, found = table.locate(ids)
            if not found.all():
                raise ValueError(f"get: field {name!r} missing for ids {ids[~found][:8].tolist()}")
            out_cols.append(self._column_runs(name, table, ids, cidx, rows, use_shm, frames, sends))
        if sends:
            self.after_reply = self.p2p.send_later(link, sends)
        return {"columns": out_cols}, frames

    @staticmethod
    def _emit(buf, off: int, nbytes: int, use_shm: bool, frames: list, sends: list | None, obj: bool) -> list:
        """One run of a get reply: p2p (bytes follow on the side group), shm (block name) or a frame."""
        if sends is not None and not obj:
            sends.append(buf.view[off:off + nbytes] if isinstance(buf, ShmBlock) else buf[off:off + nbytes])
            return ["p2p", 0, nbytes]
        if use_shm and isinstance(buf, ShmBlock):
            return [buf.name, off, nbytes]
        if isinstance(buf, ShmBlock):
            frames.append(buf.view[off:off + nbytes])
        elif hasattr(buf, "numpy"):  # a tensor received over p2p
            frames.append(buf[off:off + nbytes].cpu().numpy())
        else:
            frames.append(buf[off:off + nbytes])
        return [None, 0, nbytes]

    def _column_runs(self, name, table, ids, cidx, rows, use_shm, frames, sends) -> dict:
        n = len(ids)
        brk = np.flatnonzero((np.diff(cidx) != 0) | (np.diff(rows) != 1)) + 1 if n else np.zeros(0, np.int64)
        runs, shapes, dtypes = [], [], set()
        for s, e in zip([0, *brk.tolist()], [*brk.tolist(), n], strict=True):
            ch: Chunk = table.chunks[int(cidx[s])]
            r0, r1 = int(rows[s]), int(rows[e - 1]) + 1
            if not ch.alive[r0:r1].all():
                raise ValueError(f"get: field {name!r} was cleared for some requested ids")
            dtypes.add(ch.dtype)
            shapes.extend(ch.shapes[r0:r1])
            if ch.buf_of_row is None:
                pieces = [(ch.bufs[0], int(ch.off[r0]), int(ch.off[r1 - 1] + ch.nb[r1 - 1] - ch.off[r0]))]
            else:
                pieces = [(ch.bufs[int(ch.buf_of_row[r])], int(ch.off[r]), int(ch.nb[r])) for r in range(r0, r1)]
            obj = ch.dtype == wire.OBJECT_DTYPE
            runs.extend(self._emit(buf, off, nbytes, use_shm, frames, sends, obj) for buf, off, nbytes in pieces)
        if len(dtypes) > 1:
            raise ValueError(f"get: field {name!r} has mixed dtypes {sorted(dtypes)} across puts")
        dtype = dtypes.pop() if dtypes else "uint8"
        col = {"name": name, "dtype": dtype, "count": n, "runs": runs}
        if shapes and all(sh == shapes[0] for sh in shapes) and dtype != wire.OBJECT_DTYPE:
            col["shape"] = shapes[0]
        else:
            col["shapes"] = shapes
        return col

    def _clear(self, header: dict) -> Reply:
        ids = np.unique(_as_ids(header.get("ids")))
        only = header.get("fields")
        if only is not None and (not isinstance(only, list) or not all(isinstance(n, str) for n in only)):
            raise wire.WireError("clear: fields must be a list of names or null")
        removed = 0
        for name, table in self.tables.items():
            if only is not None and name not in only:
                continue
            cidx, rows, found = table.locate(ids)
            cidx, rows = cidx[found], rows[found]
            for c in np.unique(cidx).tolist():
                ch = table.chunks[c]
                mine = rows[cidx == c]  # ids are unique, so rows are too
                killed = int(ch.alive[mine].sum())
                ch.alive[mine] = False
                ch.nalive -= killed
                removed += killed
            for ch in table.drop_dead():
                self._release(ch.holder)
        return {"removed": removed}, []

    def close(self) -> None:
        live = {id(c.holder.block): c.holder.block for t in self.tables.values() for c in t.chunks
                if c.holder.block is not None}
        self.tables.clear()
        blocks = [b for pool in self.free.values() for b in pool] + [b for b, _ in self.pending.values()]
        self.free.clear()
        self.pending.clear()
        for b in [*blocks, *live.values()]:
            b.destroy()
        if self.p2p is not None:
            self.p2p.close()
        super().close()
