"""The shared-memory layout a storage unit and its same-node clients agree on (both sides import it;
neither owns it).

A block is a file ``SHM_DIR/hflow-tq-<pid>-<12 hex>`` created by the unit. Its first ``HEADER`` bytes are
the unit's (the lease number, uint64 little-endian); a client writes each column at an ``ALIGN``-byte
aligned offset after them. Block sizes come from ``size_class``. Shared memory is used only between
processes with the same ``node_id`` (Ray's node id inside a Ray cluster).
"""

from __future__ import annotations

import re
import socket
import sys

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


_ADOPTED_NODE: str | None = None


def node_id() -> str:
    """This process's node for the same-node decisions (shared memory, ``ipc://`` sockets, p2p links).

    In a Ray cluster (a Ray worker, or a driver connected to one) it is Ray's node id (``ray:<hex>``), so
    two Ray nodes on one machine are two nodes and take the cross-node paths between them; a server
    subprocess takes its launcher's (``adopt_node_id``); elsewhere it is the machine: hostname plus
    kernel boot id. Processes with different ids never share memory (frames over sockets instead).
    """
    if _ADOPTED_NODE is not None:
        return _ADOPTED_NODE
    ray = sys.modules.get("ray")  # never imports Ray into a process that does not use it
    if ray is not None and ray.is_initialized():
        return f"ray:{ray.get_runtime_context().get_node_id()}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def adopt_node_id(node: str) -> None:
    """Make ``node_id()`` return ``node`` in this process: a TransferQueue server subprocess runs on its
    launcher's node and takes its id (a Ray node id the subprocess could not learn itself)."""
    global _ADOPTED_NODE
    _ADOPTED_NODE = node
