"""``shm``: buckets in shared-memory slot files (one node). Every trainer rank may write its own
``Shard(0)`` rows straight into the slots (``send_shards``: no gather); rollers map the same files."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from checkpointengine.backend import WeightSyncBackend, register_backend
from checkpointengine.backends._packed import PackedReceiver, PackedSender
from checkpointengine.protocol import BucketReady, ProtocolError
from checkpointengine.storage import ShmSlots


@dataclass(frozen=True)
class ShmFields:
    """``shm_paths``: one file per bucket slot, made by the leader."""

    shm_paths: list[str] = field(default_factory=list)


class ShmSender(PackedSender):
    def __init__(self, cfg, fields: ShmFields, slots: ShmSlots):
        super().__init__(cfg, fields)
        self.slots: ShmSlots | None = slots
        self.num_slots = len(fields.shm_paths)

    @classmethod
    def create(cls, cfg) -> ShmSender:
        slots = ShmSlots.create(cfg.num_slots, cfg.bucket_bytes)
        return cls(cfg, ShmFields(list(slots.paths)), slots)

    @classmethod
    def attach(cls, cfg, handle) -> ShmSender:
        return cls(cfg, handle.fields, ShmSlots.attach(handle.fields.shm_paths, handle.bucket_bytes))

    def buffer(self, slot: int) -> torch.Tensor:
        return self.slots.buffer(slot)

    def publish(self, sender, rnd, bucket, slot: int) -> None:
        sender.control.broadcast(rnd, BucketReady(rnd.version, bucket.index, bucket.entries, bucket.used_bytes,
                                                  slot=slot))

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()  # the leader's slots unlink their files
            self.slots = None


class ShmReceiver(PackedReceiver):
    def __init__(self, handle, device):
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
