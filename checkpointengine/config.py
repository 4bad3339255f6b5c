"""The ``checkpointengine`` config section."""

from __future__ import annotations

from dataclasses import dataclass

from checkpointengine.backend import get_backend
from common.dtypes import FLOAT_DTYPES
from common.net import check_bind_host

PAUSE_MODES = ("abort", "retract", "in_place")
GROUP_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class CheckpointEngineConfig:
    """Weight plane. ``backend``: a registered weight-sync backend (``checkpointengine.backend``: shm |
    zmq | broadcast | disk, or ``module:name`` of a plug-in module); ``bucket_bytes``: bucket size in bytes; ``dtype``: dtype weights arrive in at the
    engine; ``pause_mode``: what a roller does with in-flight requests during an update (SGLang's
    ``/pause_generation`` modes); ``timeout_s``: every wait of an update; ``num_slots``: bucket buffers
    the sender cycles through (2 = double buffering: packing bucket k+1 overlaps sending k);
    ``disk_dir``: root of the ``disk`` backend's directories, one per ``weight_version`` (empty = a temp dir);
    ``group_backend``: torch.distributed backend of the ``broadcast`` group, gloo | nccl | auto (nccl
    when CUDA is available); ``reuse_receive_buffers``: a roller copies shm/zmq buckets into the tensors
    of its previous update instead of fresh memory (much faster on CPU, no page faults; costs one
    resident copy of the weights per roller between updates).

    Across nodes: ``host`` is the address the leader's control socket binds (``tcp://host:<random
    port>``; with the ``zmq`` backend every bucket travels on it too) and the ``broadcast`` backend's
    rendezvous store listens on; loopback by default, so rollers on another machine need the leader
    machine's address here: one IPv4 address, or ``node`` for the Ray node address of trainer rank 0,
    resolved there (``common.net``); rollers connect to the address the leader's handle reports.
    ``curve``: ZMQ CURVE on the control socket (``common.curve``): the leader makes the job's keys, the
    handle carries the server's public key and the client key pair to the rollers through Ray, and a peer
    without them is refused. The ``broadcast`` group itself
    (torch.distributed) is not covered: with ``curve`` a warning says so."""

    backend: str = "shm"
    bucket_bytes: int = 64 * 1024**2
    dtype: str = "float32"
    pause_mode: str = "retract"
    timeout_s: float = 120.0
    num_slots: int = 2
    disk_dir: str = ""
    group_backend: str = "auto"
    reuse_receive_buffers: bool = True
    host: str = "127.0.0.1"
    curve: bool = False

    def __post_init__(self):
        get_backend(self.backend, "checkpointengine.backend")  # ValueError listing the registered backends
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"checkpointengine.dtype={self.dtype!r} is not one of {list(FLOAT_DTYPES)}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"checkpointengine.pause_mode={self.pause_mode!r} is not one of {list(PAUSE_MODES)}"
            )
        if self.bucket_bytes < 1024:
            raise ValueError(f"checkpointengine.bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.num_slots < 2:
            raise ValueError(
                f"checkpointengine.num_slots must be >= 2 (double buffering), got {self.num_slots}"
            )
        if self.group_backend not in GROUP_BACKENDS:
            raise ValueError(
                f"checkpointengine.group_backend={self.group_backend!r} is not one of {list(GROUP_BACKENDS)}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"checkpointengine.timeout_s must be > 0, got {self.timeout_s}")
        check_bind_host("checkpointengine.host", self.host)
        if not isinstance(self.curve, bool):
            raise ValueError(f"checkpointengine.curve must be true or false, got {self.curve!r}")
