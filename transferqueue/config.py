"""The ``transferqueue`` config section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferQueueConfig:
    """Data plane. ``capacity_bytes`` per storage unit; ``shared_memory`` enables the same-node fast
    path; ``curve`` enables ZMQ CURVE auth/encryption (for sockets that leave the node); ``host`` is the
    bind address (loopback unless configured)."""

    num_storage_units: int = 2
    capacity_bytes: int = 2 * 1024**3
    shared_memory: bool = True
    curve: bool = False
    host: str = "127.0.0.1"
    request_timeout_s: float = 60.0

    def __post_init__(self):
        if self.num_storage_units < 1:
            raise ValueError(f"transferqueue.num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.capacity_bytes < 1:
            raise ValueError(f"transferqueue.capacity_bytes must be >= 1, got {self.capacity_bytes}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"transferqueue.request_timeout_s must be > 0, got {self.request_timeout_s}")
