"""Storage unit: holds tensor bytes exactly as received, keyed by (field, sample id). One process each.

::

    same node:    client --alloc(nbytes)--> unit: block "hflow-tq-…" from its shared-memory pool
                  client memcpy -> /dev/shm block;  client --put(ids, columns, block offsets)--> unit
                  (a put may ask for the next block in its reply: a steady stream of puts costs one
                  round trip to the unit each)
                  client --get(ids, fields)--> unit: [(block, offset, nbytes), ...] ; client memcpy out
    across nodes: client --put(header, frame per column)--> unit keeps the received zmq frames
                  client --get--> unit sends (zero-copy) slices of its blocks / frames

A column chunk covers one contiguous run of sample ids of one field and points into a buffer (shared
memory block or received frame); buffers are reference counted by the chunks that use them. Capacity
counts every live, pooled or leased buffer; a put that does not fit gets a ``full`` error reply (the
client retries until its timeout, then raises ``Full``), so memory never grows without bound. Blocks
freed by ``clear`` are recycled through size-class free lists, so steady-state puts write into
pre-faulted pages. A lease that ends unused (expired, a spare revoked to make room, or named by a
rejected put) destroys its block: a block is never handed to a second client while the first may still
write into it. The bookkeeping of stored rows (``CHUNK_COST`` per chunk, ``ROW_COST`` per row of a chunk
with per-row offsets) counts against a second budget of ``capacity_bytes``, so puts of zero-byte rows
cannot grow a unit's memory without bound either.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import uuid
from collections import OrderedDict

import numpy as np
import zmq

from common.curve import CurveKeys
from common.node import node_id
from transferqueue import wire
from transferqueue.chunks import (
    Chunk,
    FieldTable,
    Holder,
    chunks_of_column,
    contiguous_runs,
)
from transferqueue.records import Full
from transferqueue.server import Reply, RouterServer
from transferqueue.shm_layout import HEADER, SHM_DIR, size_class
from transferqueue.wire import as_ids, id_range

CHUNK_COST = 512  # bookkeeping bytes a chunk is counted as (a Chunk object and its table entry)
ROW_COST = 128  # ... and each row of a chunk that keeps per-row offsets, sizes and shapes


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
        self.lease_no = 0

    def stamp(self) -> None:
        """Count one more lease into the block's header. A get reply names the number its bytes were put
        under; a reader that finds another number after copying knows the block was cleared and leased
        again meanwhile (the new lessee learns of the block only after this store)."""
        self.lease_no += 1
        struct.pack_into("<Q", self.mm, 0, self.lease_no)

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


class StorageUnit(RouterServer):
    """Serves ``alloc``, ``put``, ``get``, ``clear``, ``stats`` and ``ping``; everything else is rejected."""

    def __init__(self, address: str, capacity_bytes: int, curve: CurveKeys | None = None,
                 lease_s: float = 60.0, p2p: dict | None = None, local_address: str = "",
                 max_request_ids: int = 1 << 17, max_name_chars: int = 1024):
        super().__init__(address, curve, local_address=local_address)
        self.max_request_ids = max_request_ids  # ids one put or get may name (``transferqueue.max_request_ids``)
        self.max_name_chars = max_name_chars  # ``transferqueue.max_name_chars``
        self.p2p = None
        if p2p:
            from transferqueue.p2p import UnitP2P

            host = address.split("//")[-1].rsplit(":", 1)[0] if address.startswith("tcp://") else "127.0.0.1"
            self.p2p = UnitP2P(p2p["backend"], p2p.get("device", "cpu"), host, lease_s,
                               max_links=p2p.get("max_links", 1024), max_name_chars=max_name_chars)
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self.tables: dict[str, FieldTable] = {}
        self.used_bytes = 0  # live holders + pending allocations + pooled blocks
        self.free: dict[int, list[ShmBlock]] = {}
        self.pending: dict[str, tuple[ShmBlock, float, bool]] = {}  # leased: (block, deadline, spare)
        self.gone: OrderedDict[str, None] = OrderedDict()  # leased blocks destroyed unused (recent names)
        self.sending: list[tuple[zmq.MessageTracker, ShmBlock]] = []  # zero-copy reply frames ZMQ may read
        self.draining: list[ShmBlock] = []  # cleared blocks that such frames still read: not reused yet
        self.stored_bytes = 0
        self.meta_bytes = 0  # bookkeeping of stored chunks (CHUNK_COST, ROW_COST), within capacity_bytes
        self._received = False  # a p2p put's bytes were taken off the link (no drain on failure)

    # ----------------------------------------------------------------------------------- capacity
    def _reserve(self, nbytes: int, revoke_spares: bool = True) -> None:
        """Count ``nbytes`` more as used, making room by destroying pooled blocks and (``revoke_spares``)
        spare blocks nobody wrote yet. Raises Full, destroying nothing, when that would not suffice."""
        spares = [n for n, (_, _, spare) in self.pending.items() if spare] if revoke_spares else []
        reclaimable = sum(size * len(pool) for size, pool in self.free.items()) + sum(b.size for b in self.draining)
        reclaimable += sum(self.pending[n][0].size for n in spares)
        if self.used_bytes - reclaimable + nbytes > self.capacity_bytes:
            raise Full(f"storage unit full: {self.used_bytes} of {self.capacity_bytes} bytes used, "
                            f"{nbytes} more requested")
        while self.used_bytes + nbytes > self.capacity_bytes and self.free:
            size = max(self.free)
            self._destroy(self.free[size].pop())
            if not self.free[size]:
                del self.free[size]
        while self.used_bytes + nbytes > self.capacity_bytes and self.draining:
            self._destroy(self.draining.pop(0))  # unlinked now; its pages live on until ZMQ drops the frames
        for name in spares:
            if self.used_bytes + nbytes <= self.capacity_bytes:
                break
            self._drop_lease(name)  # its client falls back to alloc
        self.used_bytes += nbytes

    def _drop_lease(self, name: str) -> None:
        """Destroy a leased block nobody wrote (revoked, expired, or named by a rejected put). It is never
        leased again, so a client still writing into its mapping harms nobody; a put naming it is answered
        ``full`` and its client allocates again."""
        self._destroy(self.pending.pop(name)[0])
        self.gone[name] = None
        while len(self.gone) > 4096:
            self.gone.popitem(last=False)

    def _destroy(self, block: ShmBlock) -> None:
        block.destroy()
        self.used_bytes -= block.size

    def _release(self, holder: Holder) -> None:
        holder.refs -= 1
        if holder.refs:
            return
        self.stored_bytes -= holder.nbytes
        if holder.block is not None:  # stays counted in used_bytes
            self._prune_sending()
            self._give_back(holder.block)
        else:
            self.used_bytes -= holder.nbytes
            holder.frames.clear()

    def _give_back(self, block: ShmBlock) -> None:
        """Pool a cleared block, or keep it in ``draining`` while zero-copy frames of it are still queued."""
        if any(b is block for _, b in self.sending):
            self.draining.append(block)
        else:
            self.free.setdefault(block.size, []).append(block)

    def _prune_sending(self) -> None:
        if self.sending:
            self.sending = [(t, b) for t, b in self.sending if not t.done]

    def tick(self) -> None:
        if self.p2p is not None:
            self.p2p.poll()
        self._prune_sending()
        if self.draining:
            blocks, self.draining = self.draining, []
            for b in blocks:
                self._give_back(b)
        now = time.monotonic()
        for name in [n for n, (_, deadline, _) in self.pending.items() if deadline < now]:
            self._drop_lease(name)  # its client may still write into it: never hand it to another

    # ------------------------------------------------------------------------------------- handle
    def handle(self, identity: bytes, header: dict, frames: list) -> Reply | None:
        op = header["op"]
        if op == "put":
            try:
                return self._put(header, frames)
            except Exception:
                shm = header.get("shm")
                if isinstance(shm, dict) and isinstance(shm.get("block"), str) and shm["block"] in self.pending:
                    self._drop_lease(shm["block"])  # a rejected put's block: free its capacity now
                raise
        if op == "get":
            return self._get(header)
        if op == "alloc":
            return self._alloc(header)
        if op == "clear":
            return self._clear(header)
        if op == "stats":
            return {"used_bytes": self.used_bytes, "stored_bytes": self.stored_bytes,
                    "capacity_bytes": self.capacity_bytes, "meta_bytes": self.meta_bytes, "fields": len(self.tables),
                    "chunks": sum(len(t.chunks) for t in self.tables.values()), "requests": self.requests}, []
        if op == "ping":
            return {}, []
        if op == "p2p_connect":
            if self.p2p is None:
                raise ValueError("this storage unit has no p2p device path (transferqueue.p2p_backend)")
            reply, self.after_reply = self.p2p.connect(header, node_id())
            return reply, []
        raise wire.WireError(f"unknown op {op!r} for a storage unit")

    def _alloc(self, header: dict) -> Reply:
        return self._lease(header.get("nbytes"), "alloc", spare=False), []

    def _lease(self, nbytes, what: str, spare: bool) -> dict:
        """Lease a block of at least ``nbytes`` to one client until ``lease_s`` from now (then it is
        destroyed unless a put used it). A ``spare`` (asked for in advance by a put) is taken back when the
        unit needs its space, and never takes another client's spare. Raises WireError for a bad size,
        Full when it does not fit."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise wire.WireError(f"{what}: nbytes must be a non-negative int, got {nbytes!r}")
        size = HEADER + size_class(max(nbytes - HEADER, 0))  # the header rides on top of a data size class
        pool = self.free.get(size)
        if pool:
            block = pool.pop()
            if not pool:
                del self.free[size]
        else:
            self._reserve(size, revoke_spares=not spare)
            block = ShmBlock(size)
        block.stamp()
        self.pending[block.name] = (block, time.monotonic() + self.lease_s, spare)
        return {"block": block.name, "size": block.size, "lease_s": self.lease_s}

    def _put(self, header: dict, frames: list) -> Reply:
        raw_ids = header.get("ids")
        lo = id_range(raw_ids)  # consecutive ids: no per-id work below
        ids = as_ids(raw_ids) if lo is None else np.arange(lo, lo + len(raw_ids), dtype=np.int64)
        n = len(ids)
        if n > self.max_request_ids:  # the fast path pays one comparison
            wire.check_id_count("put", n, self.max_request_ids)
        cols = header.get("columns")
        if not isinstance(cols, list) or not cols:
            raise wire.WireError("put: columns must be a non-empty list")
        cols = [wire.validate_column(c, n, self.max_name_chars) for c in cols]
        if len({c["name"] for c in cols}) != len(cols):
            raise wire.WireError("put: duplicate column names")
        if lo is None and len(set(ids.tolist())) != n:
            raise wire.WireError("put: duplicate ids")
        link = header.get("p2p")
        lease = header.get("lease")
        self._received = False
        try:
            if lease is not None and (not isinstance(lease, int) or lease < 0):
                raise wire.WireError(f"put: lease must be a non-negative int (bytes), got {lease!r}")
            runs = [(0, n)] if lo is not None else contiguous_runs(ids)
            per_row = 0  # columns whose chunks keep per-row offsets (variable shapes, a frame per row)
            for c in cols:
                per_row += "shape" not in c or c["split"]
                table = self.tables.get(c["name"])
                if table is not None and (table.overlapping(lo, lo + n) if lo is not None else table.locate(ids)[2].any()):
                    raise ValueError(f"put: field {c['name']!r} already stored for some of these ids")
            meta = CHUNK_COST * len(runs) * len(cols) + ROW_COST * n * per_row
            if self.meta_bytes + meta > self.capacity_bytes:
                raise Full(f"storage unit full: bookkeeping of stored rows takes {self.meta_bytes} of "
                                f"{self.capacity_bytes} bytes, this put's {meta} more")
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
        self.meta_bytes += meta
        for c, (bufs, buf_of_row, off) in zip(cols, placed, strict=True):
            table = self.tables.setdefault(c["name"], FieldTable())
            for chunk in chunks_of_column(c, ids, runs, holder, bufs, buf_of_row, off):
                table.insert(chunk)
                holder.refs += 1
        if holder.refs == 0:  # zero samples
            holder.refs = 1
            self._release(holder)
        reply = {"nbytes": holder.nbytes}
        if lease is not None:  # the block for the client's next shared-memory put: saves it an alloc
            try:
                reply["lease"] = self._lease(lease, "put: lease", spare=True)
            except Full:
                pass  # the put itself succeeded; the next one allocates (and waits) as usual
        return reply, []

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
                placed.append(([np.frombuffer(frames[pos].buffer, dtype=np.uint8)], None, 0))
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
        return Holder(nbytes, frames=bufs), [([buf], None, 0) for buf in bufs]

    def _shm_placement(self, cols: list[dict], shm) -> tuple[Holder, list]:
        if isinstance(shm, dict) and shm.get("block") in self.gone:
            raise Full(f"put: block {shm['block']} was taken back (lease ended or room needed); "
                            "allocate again")
        if not isinstance(shm, dict) or shm.get("block") not in self.pending:
            raise wire.WireError("put: shm.block must name a block allocated to this client and not yet used")
        offsets = shm.get("offsets")
        if not isinstance(offsets, list) or len(offsets) != len(cols) or not all(isinstance(o, int) for o in offsets):
            raise wire.WireError("put: shm.offsets must hold one int offset per column")
        block, _, _ = self.pending[shm["block"]]
        end = HEADER  # the block's header is the unit's
        for c, o in zip(cols, offsets, strict=True):
            if c["split"] or o < end or o + c["nbytes"] > block.size:
                raise wire.WireError(f"put: column {c['name']!r} at offset {o} overlaps or leaves the block")
            end = o + c["nbytes"]
        del self.pending[shm["block"]]
        holder = Holder(block.size, block=block)
        self.stored_bytes += block.size
        return holder, [([block], None, o) for o in offsets]

    def _get(self, header: dict) -> Reply:
        raw_ids = header.get("ids")
        lo = id_range(raw_ids)
        ids = as_ids(raw_ids) if lo is None else np.arange(lo, lo + len(raw_ids), dtype=np.int64)
        wire.check_id_count("get", len(ids), self.max_request_ids)
        names = header.get("fields")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise wire.WireError("get: fields must be a non-empty list of names")
        use_shm = bool(header.get("shm"))
        link = header.get("p2p")
        if link is not None and self.p2p is None:
            raise ValueError("get: this storage unit has no p2p device path")
        out_cols, frames, sends = [], [], ([] if link is not None else None)
        n = len(ids)
        for name in names:
            table = self.tables.get(name)
            if table is None:
                raise ValueError(f"get: field {name!r} is not stored on this unit (never put, or cleared)")
            ch = table.covering(lo, lo + n) if lo is not None else None
            if ch is not None:  # the common case: consecutive ids put together
                segments = [(ch, lo - ch.start, lo + n - ch.start)]
            else:
                segments = self._segments(name, table, ids)
            out_cols.append(self._column_runs(name, n, segments, use_shm, frames, sends))
        if sends:
            self.after_reply = self.p2p.send_later(link, sends)
        return {"columns": out_cols}, frames

    def _emit(self, buf, off: int, nbytes: int, use_shm: bool, frames: list, sends: list | None, obj: bool) -> list:
        """One run of a get reply: p2p (bytes follow on the side group), shm (block name) or a frame."""
        if sends is not None and not obj:
            sends.append(buf.view[off:off + nbytes] if isinstance(buf, ShmBlock) else buf[off:off + nbytes])
            return ["p2p", 0, nbytes]
        if use_shm and isinstance(buf, ShmBlock):
            return [buf.name, off, nbytes, buf.lease_no]
        if isinstance(buf, ShmBlock):  # ZMQ reads it after the reply is queued: no reuse until it is done
            frame = zmq.Frame(buf.view[off:off + nbytes], copy=False, track=True)
            self.sending.append((frame.tracker, buf))
            frames.append(frame)
        elif hasattr(buf, "numpy"):  # a tensor received over p2p
            frames.append(buf[off:off + nbytes].cpu().numpy())
        else:
            frames.append(buf[off:off + nbytes])
        return [None, 0, nbytes]

    @staticmethod
    def _segments(name: str, table: FieldTable, ids: np.ndarray) -> list[tuple[Chunk, int, int]]:
        """``(chunk, first row, end row)`` for each maximal run of ``ids`` stored consecutively in one chunk.
        Raises ValueError naming missing ids."""
        cidx, rows, found = table.locate(ids)
        if not found.all():
            raise ValueError(f"get: field {name!r} missing for ids {ids[~found][:8].tolist()}")
        n = len(ids)
        brk = np.flatnonzero((np.diff(cidx) != 0) | (np.diff(rows) != 1)) + 1 if n else np.zeros(0, np.int64)
        return [(table.chunks[int(cidx[s])], int(rows[s]), int(rows[e - 1]) + 1)
                for s, e in zip([0, *brk.tolist()], [*brk.tolist(), n], strict=True)]

    def _column_runs(self, name: str, n: int, segments, use_shm, frames, sends) -> dict:
        runs, pieces_shapes, dtypes = [], [], set()
        for ch, r0, r1 in segments:
            if not ch.all_alive(r0, r1):
                raise ValueError(f"get: field {name!r} was cleared for some requested ids")
            dtypes.add(ch.dtype)
            pieces_shapes.append((ch.shape, r1 - r0) if ch.shape is not None else (None, ch.shapes[r0:r1]))
            obj = ch.dtype == wire.OBJECT_DTYPE
            runs.extend(self._emit(buf, off, nbytes, use_shm, frames, sends, obj)
                        for buf, off, nbytes in ch.pieces(r0, r1))
        if len(dtypes) > 1:
            raise ValueError(f"get: field {name!r} has mixed dtypes {sorted(dtypes)} across puts")
        dtype = dtypes.pop() if dtypes else "uint8"
        col = {"name": name, "dtype": dtype, "count": n, "runs": runs}
        fixed = {tuple(sh) for sh, _ in pieces_shapes if sh is not None}
        if len(fixed) == 1 and all(sh is not None for sh, _ in pieces_shapes) and dtype != wire.OBJECT_DTYPE:
            col["shape"] = pieces_shapes[0][0]  # the common case: no per-row shapes at all
            return col
        shapes = [row for sh, rows in pieces_shapes for row in ([sh] * rows if sh is not None else rows)]
        if shapes and all(sh == shapes[0] for sh in shapes) and dtype != wire.OBJECT_DTYPE:
            col["shape"] = shapes[0]
        else:
            col["shapes"] = shapes
        return col

    def _clear(self, header: dict) -> Reply:
        raw_ids = header.get("ids")
        lo = id_range(raw_ids)
        ids = None if lo is not None else np.unique(as_ids(raw_ids))
        only = header.get("fields")
        if only is not None and (not isinstance(only, list) or not all(isinstance(n, str) for n in only)):
            raise wire.WireError("clear: fields must be a list of names or null")
        removed = 0
        for name, table in self.tables.items():
            if only is not None and name not in only:
                continue
            if lo is not None:  # consecutive ids: the overlapping chunks, one slice each
                hi = lo + len(raw_ids)
                for ch in table.overlapping(lo, hi):
                    removed += ch.kill(slice(max(lo - ch.start, 0), min(hi - ch.start, ch.count)))
            else:
                cidx, rows, found = table.locate(ids)
                cidx, rows = cidx[found], rows[found]
                for c in np.unique(cidx).tolist():
                    removed += table.chunks[c].kill(rows[cidx == c])  # ids are unique, so rows are too
            for ch in table.drop_dead():
                self.meta_bytes -= CHUNK_COST + (ROW_COST * ch.count if ch.off is not None else 0)
                self._release(ch.holder)
        for name in [name for name, table in self.tables.items() if not table.chunks]:
            del self.tables[name]  # a field name is not kept once nothing of it is stored
        return {"removed": removed}, []

    def close(self) -> None:
        live = {id(c.holder.block): c.holder.block for t in self.tables.values() for c in t.chunks
                if c.holder.block is not None}
        self.tables.clear()
        blocks = [b for pool in self.free.values() for b in pool] + [b for b, _, _ in self.pending.values()]
        blocks += self.draining
        self.draining = []
        self.free.clear()
        self.pending.clear()
        for b in [*blocks, *live.values()]:
            b.destroy()
        if self.p2p is not None:
            self.p2p.close()
        super().close()
