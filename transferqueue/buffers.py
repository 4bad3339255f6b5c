"""Client-side buffers: mappings of storage units' shared-memory blocks, the caching pool of output
buffers ``get`` fills, and the copy that assembles a field from its sources."""

from __future__ import annotations

import mmap
import os
import re
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

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

    def close(self) -> None:
        while self.maps:
            self.maps.popitem()


POPULATE_MIN_BYTES = 1 << 20


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
