"""Client-side buffers: mappings of storage units' shared-memory blocks, the caching pool of output
buffers ``get`` fills, and the copy that assembles a field from its sources."""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from transferqueue import wire
from transferqueue.chunks import contiguous_runs
from transferqueue.records import RemoteError
from transferqueue.storage import SHM_DIR, size_class

_SHM_NAME = re.compile(r"hflow-tq-\d+-[0-9a-f]{12}")


class ShmCache:
    """Mappings of storage units' shared-memory blocks, opened on first use (bounded LRU)."""

    def __init__(self, max_open: int = 256):
        self.maps: OrderedDict[str, tuple[mmap.mmap, np.ndarray]] = OrderedDict()
        self.max_open = max_open
        self.lock = threading.Lock()

    def view(self, name: str) -> np.ndarray:
        with self.lock:
            return self._view(name)

    def _view(self, name: str) -> np.ndarray:
        hit = self.maps.get(name)
        if hit is not None:
            self.maps.move_to_end(name)
            return hit[1]
        if not isinstance(name, str) or not _SHM_NAME.fullmatch(name):
            raise RemoteError(f"storage unit named an invalid shared-memory block {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.maps[name] = (mm, np.frombuffer(mm, dtype=np.uint8))
        while len(self.maps) > self.max_open:
            _, (old, _) = self.maps.popitem(last=False)
            try:
                old.close()
            except BufferError:  # a caller's view still uses it; it closes when collected
                pass
        return self.maps[name][1]

    def read_view(self, name: str, field: str) -> np.ndarray:
        """``view`` for reading a get's run: raises RemoteError when the block cannot be opened (the unit
        destroyed it: the field was cleared, and its room taken, since the unit named it)."""
        try:
            return self.view(name)
        except (OSError, ValueError) as exc:  # gone, or truncated to nothing: mmap refuses an empty file
            raise RemoteError(f"get: field {field!r} was cleared while being read (block {name} is gone: "
                              f"{type(exc).__name__})") from None

    def check_leases(self, replies: list) -> None:
        """After copying a get's shared-memory runs and before decoding any of it: raise RemoteError if a
        block was cleared and leased again while we read it (its header's lease number moved on; the copy
        may hold another put's bytes). ``replies``: the units' ``(header, frames)`` get replies."""
        for head, _ in replies:
            for col in head["columns"]:
                for run in col["runs"]:
                    if len(run) == 4:  # a shared-memory run: [block, offset, nbytes, lease number]
                        (now,) = struct.unpack_from("<Q", self.read_view(run[0], col["name"]), 0)
                        if now != run[3]:
                            raise RemoteError(f"get: field {col['name']!r} was cleared while being read "
                                              f"(block {run[0]} leased again)")

    def forget(self, name: str) -> None:
        """Unmap block ``name`` (its unit destroyed it), so its memory can go back to the system."""
        with self.lock:
            hit = self.maps.pop(name, None)
        if hit is not None:
            try:
                hit[0].close()
            except BufferError:  # a caller's view still uses it; it closes when collected
                pass

    def close(self) -> None:
        while self.maps:
            self.maps.popitem()


POPULATE_MIN_BYTES = 64 << 10  # smaller buffers come from malloc


class BufferPool:
    """Where ``get`` allocates the caller's output buffers: a bounded cache of freed buffers, like PyTorch's
    caching allocator. A large buffer is an anonymous mapping pre-faulted by the kernel in one call
    (MAP_POPULATE); when every tensor viewing it is gone (``weakref.finalize``), the mapping goes back to
    the cache (up to ``max_bytes``) so the next ``get`` of that size class copies into already-faulted
    pages. While any tensor of a batch lives, its memory belongs to the caller alone."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self.free: dict[int, list[mmap.mmap]] = {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes < POPULATE_MIN_BYTES or not hasattr(mmap, "MAP_POPULATE"):
            return np.empty(nbytes, dtype=np.uint8)
        size = size_class(nbytes)
        with self.lock:
            pool = self.free.get(size)
            mm = pool.pop() if pool else None
            if mm is not None:
                self.cached_bytes -= size
        if mm is None:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._give_back, mm, size)
        return arr

    def _give_back(self, mm: mmap.mmap, size: int) -> None:
        with self.lock:
            if self.cached_bytes + size <= self.max_bytes:
                self.free.setdefault(size, []).append(mm)
                self.cached_bytes += size

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.cached_bytes = 0


def merge_copy(out, src: list, dst: list[tuple[int, int]]) -> None:
    """Copy the byte stream ``src`` (buffers back to back) into ``out`` at ``dst`` segments
    ``(offset, nbytes)`` (same total length), one copy per overlap of a source and a segment.
    ``out`` and the sources are uint8 numpy arrays or torch tensors (any device)."""
    si, so = 0, 0
    for off, n in dst:
        while n:
            while si < len(src) and so == len(src[si]):
                si, so = si + 1, 0
            take = min(n, len(src[si]) - so)
            piece = src[si][so:so + take]
            if isinstance(out, np.ndarray):
                np.copyto(out[off:off + take], piece)
            else:
                out[off:off + take].copy_(piece if isinstance(piece, torch.Tensor) else host_tensor(piece))
            off, n, so = off + take, n - take, so + take


def host_tensor(arr: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over a (possibly read-only) host buffer, only ever read from."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr) if arr.size else torch.empty(0, dtype=torch.uint8)


def assemble_field(j: int, name: str, count: int, routes, replies, received, alloc,
                   shm: ShmCache) -> tuple[dict, np.ndarray | torch.Tensor]:
    """Copy field ``name`` (column ``j`` of every unit's reply) in meta order into one fresh buffer from
    ``alloc(nbytes, dtype)``. ``routes``: ``(unit, positions)``; ``received``: p2p tensors per reply.
    Returns ``(descriptor, buffer)``, not yet decoded: the caller checks the leases of the shared-memory
    runs first (``ShmCache.check_leases``), then ``wire.decode_column`` turns it into what ``Batch``
    holds. Raises RemoteError for inconsistent replies."""
    cols = [head["columns"][j] for head, _ in replies]
    dtypes = {col["dtype"] for col in cols}
    if len(dtypes) != 1:
        raise RemoteError(f"field {name!r} has mixed dtypes across units: {sorted(dtypes)}")
    dtype = dtypes.pop()
    for col, (_, pos) in zip(cols, routes, strict=True):
        if col.get("count") != len(pos) or len(col.get("shapes", pos)) != len(pos):
            raise RemoteError(f"unit returned {col.get('count')} rows of {name!r}, expected {len(pos)}")
    shape = cols[0].get("shape")
    if dtype != wire.OBJECT_DTYPE and shape is not None and all(col.get("shape") == shape for col in cols):
        row = math.prod(shape) * wire.ITEMSIZE[dtype]  # the common case: one fixed shape, no per-row work
        out = alloc(count * row, dtype)
        _copy_routes(out, j, routes, replies, received, shm, lambda p: p * row)
        return {"name": name, "dtype": dtype, "count": count, "shape": shape}, out
    row_nb = np.zeros(count, dtype=np.int64)
    shapes: list = [None] * count
    for col, (_, pos) in zip(cols, routes, strict=True):
        col_shapes = col["shapes"] if "shapes" in col else [col["shape"]] * col["count"]
        row_nb[pos] = wire.row_nbytes({"dtype": dtype, "count": len(pos), "shapes": col_shapes})
        for p, sh in zip(pos.tolist(), col_shapes, strict=True):
            shapes[p] = sh
    dst_off = np.concatenate([[0], np.cumsum(row_nb)]).astype(np.int64)
    out = alloc(int(dst_off[-1]), dtype)
    _copy_routes(out, j, routes, replies, received, shm, lambda p: int(dst_off[p]))
    desc = {"name": name, "dtype": dtype, "count": count}
    if dtype != wire.OBJECT_DTYPE and all(sh == shapes[0] for sh in shapes):
        desc["shape"] = shapes[0]
    else:
        desc["shapes"] = shapes
    return desc, out


def _copy_routes(out, j: int, routes, replies, received, shm: ShmCache, offset) -> None:
    """Copy column ``j`` of every reply into ``out``; ``offset(p)``: byte offset of row position ``p``."""
    for (_, pos), (head, frames), got in zip(routes, replies, received, strict=True):
        src = run_sources(head, frames, got, j, shm)
        # positions are sorted and distinct: first and last tell whether they form one segment
        runs = [(0, len(pos))] if len(pos) and pos[-1] - pos[0] == len(pos) - 1 else contiguous_runs(pos)
        bounds = [(int(pos[s]), int(pos[s]) + n) for s, n in runs]
        merge_copy(out, src, [(offset(lo), offset(hi) - offset(lo)) for lo, hi in bounds])


def run_sources(head: dict, frames: list, received: list, j: int, shm: ShmCache) -> list:
    """Source buffers of column ``j`` of one reply, in row order (shm views, frames or p2p tensors)."""
    fi = sum(1 for col in head["columns"][:j] for run in col["runs"] if run[0] is None)
    pi = sum(1 for col in head["columns"][:j] for run in col["runs"] if run[0] == "p2p")
    src = []
    for seg, off, nbytes, *_ in head["columns"][j]["runs"]:
        if seg is None:
            if fi >= len(frames):
                raise RemoteError("reply announces more frames than it carries")
            buf = np.frombuffer(frames[fi].buffer, dtype=np.uint8)
            fi += 1
        elif seg == "p2p":
            if pi >= len(received):
                raise RemoteError("reply announces more p2p runs than were received")
            buf = received[pi]
            pi += 1
        else:
            buf = shm.read_view(seg, head["columns"][j]["name"])[off:off + nbytes]
        if len(buf) != nbytes:
            raise RemoteError(f"run of {len(buf)} bytes where {nbytes} were announced")
        src.append(buf)
    return src
