"""A weight-sync backend from outside the package, selected as
``checkpointengine.backend=tests.checkpointengine.plugin_backend:frames``: the whole of what adding a
backend takes (this module; its test is ``test_backend_registry``).

``frames``: whole tensors (cast to the engine dtype), one ZMQ frame each after the bucket's
``BucketReady``; a ``tag`` handle field shows typed per-backend fields travelling to the rollers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from checkpointengine.backend import WeightSyncBackend, register_backend
from checkpointengine.backend_sides import BackendReceiver, BackendSender
from checkpointengine.backends._whole import whole_buckets, whole_entries
from checkpointengine.protocol import BucketReady, ProtocolError


@dataclass(frozen=True)
class FramesFields:
    tag: str = ""


class FramesSender(BackendSender):
    @classmethod
    def create(cls, cfg) -> FramesSender:
        return cls(cfg, FramesFields(tag="frames-v1"))

    def full_body(self, sender, stream):
        def run(rnd) -> tuple[int, int]:
            index = total = 0
            for bucket in whole_buckets(sender, stream):
                entries = whole_entries(bucket)
                frames = [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for _, t in bucket]
                used = sum(e.nbytes for e in entries)
                sender.control.broadcast(rnd, BucketReady(rnd.weight_version, index, entries, used), frames=frames)
                index, total = index + 1, total + used
            return index, total

        return run


class FramesReceiver(BackendReceiver):
    def bucket_tensors(self, msg, frames, unpacker, copy, consumed):
        if self.handle.fields.tag != "frames-v1" or len(frames) != len(msg.entries):
            raise ProtocolError(f"bucket {msg.index}: {len(frames)} frames for {len(msg.entries)} tensors")
        out = []
        for entry, frame in zip(msg.entries, frames, strict=True):
            raw = torch.frombuffer(bytearray(frame.buffer), dtype=torch.uint8) if entry.nbytes else \
                torch.empty(0, dtype=torch.uint8)
            out.append((entry.name, raw.view(entry.torch_dtype).reshape(entry.shape).to(self.device)))
        consumed()
        yield from out


FRAMES = register_backend("frames", WeightSyncBackend(FramesSender, FramesReceiver, FramesFields))
