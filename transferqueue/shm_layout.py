"""The shared-memory layout a storage unit and its same-node clients agree on (both sides import it;
neither owns it).

A block is a file ``SHM_DIR/hflow-tq-<pid>-<12 hex>`` created by the unit. Its first ``HEADER`` bytes are
the unit's (the lease number, uint64 little-endian); a client writes each column at an ``ALIGN``-byte
aligned offset after them. Block sizes come from ``size_class``. Shared memory is used only between
processes with the same ``common.node.node_id`` (Ray's node id inside a Ray cluster).
"""

from __future__ import annotations

import re

SHM_DIR = "/dev/shm"
ALIGN = 64
HEADER = ALIGN  # bytes at the start of every block the unit owns: the lease number (uint64, little-endian)
BLOCK_NAME = re.compile(r"hflow-tq-\d+-[0-9a-f]{12}")


def size_class(nbytes: int) -> int:
    """Block size for ``nbytes``: rounded up to 1/8 of its power of two (<= 12.5% waste), min 64 KiB."""
    n = max(nbytes, 64 * 1024)
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN
