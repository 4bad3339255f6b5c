"""The ``checkpointengine`` config section."""

from __future__ import annotations

from dataclasses import dataclass

from checkpointengine.backend import get_backend
from common.dtypes import FLOAT_DTYPES
from common.net import check_bind_host
from common.settings import check_settings, setting

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

    backend: str = setting(
        "shm", doc="how weights reach rollers: shm | zmq | broadcast (SGLang protocol) | disk")
    bucket_bytes: int = setting(64 * 1024**2, ge=1024, doc="size of one weight bucket, bytes")
    dtype: str = setting("float32", choices=FLOAT_DTYPES, doc="dtype weights are sent in")
    pause_mode: str = setting(
        "retract", choices=PAUSE_MODES, doc="what rollers do with in-flight requests during an update")
    timeout_s: float = setting(120.0, gt=0, doc="bound in seconds on every wait of a weight update")
    num_slots: int = setting(2, ge=2, doc="bucket buffers the sender cycles through (2 = double buffering)")
    disk_dir: str = setting(
        "", doc="root of the disk backend's directories, one per weight_version; empty = a temp dir")
    group_backend: str = setting(
        "auto", choices=GROUP_BACKENDS,
        doc="torch.distributed backend of the broadcast group; auto: nccl with CUDA")
    reuse_receive_buffers: bool = setting(
        True, doc="rollers copy buckets into their previous update's tensors")
    host: str = setting(
        "127.0.0.1",
        doc="bind address of the weight plane's cross-node sockets: IPv4 "
            "(loopback) | node (rank 0's)")
    curve: bool = setting(
        False, doc="ZMQ CURVE on the weight plane's control socket (keys handed out through Ray)")

    def __post_init__(self):
        check_settings(self, "checkpointengine")
        get_backend(self.backend, "checkpointengine.backend")  # ValueError listing the registered backends
        check_bind_host("checkpointengine.host", self.host)
        if not isinstance(self.curve, bool):
            raise ValueError(f"checkpointengine.curve must be true or false, got {self.curve!r}")
