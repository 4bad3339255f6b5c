"""``shm``: buckets in shared-memory slot files (one node). Every trainer rank may write its own
``Shard(0)`` rows straight into the slots (``send_shards``: no gather); rollers map the same files."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from checkpointengine.backend import WeightSyncBackend, register_backend
from checkpointengine.backends._packed import PackedReceiver, PackedSender
from checkpointengine.protocol import BucketReady, ProtocolError
from checkpointengine.storage import ShmSlots
from common.node import node_id


@dataclass(frozen=True)
class ShmFields:
    """``shm_paths``: one file per bucket slot, made by the leader; ``node``: the leader's node
    (``common.node.node_id``: its Ray node in a Ray cluster), the only node whose rollers can map them."""

    shm_paths: list[str] = field(default_factory=list)
    node: str = ""


class ShmSender(PackedSender):
    def __init__(self, cfg, fields: ShmFields, slots: ShmSlots):
        super().__init__(cfg, fields)
        self.slots: ShmSlots | None = slots
        self.num_slots = len(fields.shm_paths)

    @classmethod
    def create(cls, cfg) -> ShmSender:
        slots = ShmSlots.create(cfg.num_slots, cfg.bucket_bytes)
        return cls(cfg, ShmFields(list(slots.paths), node_id()), slots)

    @classmethod
    def attach(cls, cfg, handle) -> ShmSender:
        """Another trainer rank maps the leader's slots; ValueError when it is on another node than the leader."""
        here = node_id()
        if handle.fields.node and handle.fields.node != here:
            raise ValueError(f"checkpointengine.backend={handle.backend}: every trainer rank writes its shards into "
                             f"shared memory on rank 0's node {handle.fields.node}, but this rank is on node {here}: "
                             "use checkpointengine.backend=zmq (or broadcast on GPUs) when trainer ranks span nodes")
        return cls(cfg, handle.fields, ShmSlots.attach(handle.fields.shm_paths, handle.bucket_bytes))

    def buffer(self, slot: int) -> torch.Tensor:
        return self.slots.buffer(slot)

    def publish(self, sender, rnd, bucket, slot: int) -> None:
        sender.control.broadcast(rnd, BucketReady(rnd.weight_version, bucket.index, bucket.entries, bucket.used_bytes,
                                                  slot=slot))

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()  # the leader's slots unlink their files
            self.slots = None


class ShmReceiver(PackedReceiver):
    """Maps the leader's slot files; ValueError when this roller is on another node than the leader."""

    def __init__(self, handle, device):
        here = node_id()
        if handle.fields.node and handle.fields.node != here:
            raise ValueError(f"checkpointengine.backend={handle.backend} moves weights through shared memory on one "
                             f"node, but this roller is on node {here} and the trainer on {handle.fields.node}: "
                             "use checkpointengine.backend=zmq (or broadcast on GPUs) across nodes")
        super().__init__(handle, device)
        self.slots: ShmSlots | None = ShmSlots.attach(handle.fields.shm_paths, handle.bucket_bytes)

    def payload(self, msg: BucketReady, frames: list) -> tuple[torch.Tensor, bool]:
        if not 0 <= msg.slot < len(self.handle.fields.shm_paths):
            raise ProtocolError(f"bucket {msg.index}: slot {msg.slot} out of range")
        return self.slots.buffer(msg.slot)[: msg.used_bytes], True

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None


SHM = register_backend("shm", WeightSyncBackend(ShmSender, ShmReceiver, ShmFields, supports_shards=True))
