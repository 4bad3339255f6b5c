"""``zmq``: each bucket travels as a frame after its ``BucketReady`` on the control socket (any host)."""

from __future__ import annotations

import torch

from checkpointengine.backend import NoFields, WeightSyncBackend, register_backend
from checkpointengine.backends._packed import PackedReceiver, PackedSender
from checkpointengine.protocol import BucketReady, ProtocolError


class ZmqSender(PackedSender):
    def __init__(self, cfg, fields=NoFields()):
        super().__init__(cfg, fields)
        self.num_slots = cfg.num_slots
        self.buffers = [torch.empty(cfg.bucket_bytes, dtype=torch.uint8) for _ in range(cfg.num_slots)]

    def buffer(self, slot: int) -> torch.Tensor:
        return self.buffers[slot]

    def publish(self, sender, rnd, bucket, slot: int) -> None:
        msg = BucketReady(rnd.weight_version, bucket.index, bucket.entries, bucket.used_bytes, slot=slot)
        sender.control.broadcast(rnd, msg, frames=[memoryview(self.buffers[slot][: bucket.used_bytes].numpy())])


class ZmqReceiver(PackedReceiver):
    def payload(self, msg: BucketReady, frames: list) -> tuple[torch.Tensor, bool]:
        if len(frames) != 1 or len(frames[0]) != msg.used_bytes:
            raise ProtocolError(f"bucket {msg.index}: payload frame missing or of the wrong size")
        if not msg.used_bytes:
            return torch.empty(0, dtype=torch.uint8), False
        return torch.frombuffer(frames[0].buffer, dtype=torch.uint8), False  # released with this bucket


ZMQ = register_backend("zmq", WeightSyncBackend(ZmqSender, ZmqReceiver))
