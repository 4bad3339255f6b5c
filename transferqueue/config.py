"""The ``transferqueue`` config section."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransferQueueConfig:
    """Data plane. ``capacity_bytes`` per storage unit; ``shared_memory`` enables the same-node fast
    path; ``curve`` enables ZMQ CURVE auth/encryption (for sockets that leave the node); ``host`` is the
    bind address (loopback unless configured).

    ``route_block``: samples ``[k*route_block, (k+1)*route_block)`` live on unit ``k % num_storage_units``.
    ``shm_min_bytes``: puts smaller than this go over ZMQ frames even on one node (a shared-memory put
    costs one more round trip). ``sampler_modules``: modules the index imports at start so their
    ``register_sampler`` calls add custom samplers. ``start_timeout_s``: how long to wait for servers.
    """

    num_storage_units: int = 2
    capacity_bytes: int = 2 * 1024**3
    shared_memory: bool = True
    curve: bool = False
    host: str = "127.0.0.1"
    request_timeout_s: float = 60.0
    route_block: int = 64
    shm_min_bytes: int = 64 * 1024
    sampler_modules: list[str] = field(default_factory=list)
    start_timeout_s: float = 60.0
    p2p_backend: str = ""
    p2p_device: str = "cpu"

    def __post_init__(self):
        if self.num_storage_units < 1:
            raise ValueError(f"transferqueue.num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.capacity_bytes < 1:
            raise ValueError(f"transferqueue.capacity_bytes must be >= 1, got {self.capacity_bytes}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"transferqueue.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.route_block < 1:
            raise ValueError(f"transferqueue.route_block must be >= 1, got {self.route_block}")
        if self.shm_min_bytes < 0:
            raise ValueError(f"transferqueue.shm_min_bytes must be >= 0, got {self.shm_min_bytes}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"transferqueue.start_timeout_s must be > 0, got {self.start_timeout_s}")
        if self.p2p_backend not in ("", "gloo", "nccl"):
            raise ValueError(f"transferqueue.p2p_backend must be '', 'gloo' or 'nccl', got {self.p2p_backend!r}")
        if self.p2p_device not in ("cpu", "cuda"):
            raise ValueError(f"transferqueue.p2p_device must be 'cpu' or 'cuda', got {self.p2p_device!r}")
        if self.p2p_backend == "nccl" and self.p2p_device != "cuda":
            raise ValueError("transferqueue.p2p_backend=nccl needs transferqueue.p2p_device=cuda")
        if not self.host or any(c in self.host for c in "/ :"):
            raise ValueError(f"transferqueue.host must be a host name or IPv4 address, got {self.host!r}")
