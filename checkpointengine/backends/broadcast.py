"""``broadcast``: a ``torch.distributed`` group of trainer rank 0 and the rollers, formed the way SGLang
forms its weight-update group (``checkpointengine.broadcast``); each bucket's tensors are broadcast by
rank 0 after their ``BucketReady``. The group is re-formed (``GroupInit`` before ``Begin``) whenever the
set of rollers in an update changes. The group's rendezvous store listens on ``checkpointengine.host``
(the address ``GroupInit`` names); the group's own traffic (gloo/NCCL) is torch.distributed's, which
``checkpointengine.curve`` cannot cover: the sender logs a warning when both are set."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import torch

from checkpointengine import broadcast as bc
from checkpointengine.backend import WeightSyncBackend, register_backend
from checkpointengine.backend_sides import BackendReceiver, BackendSender
from checkpointengine.backends._whole import whole_buckets, whole_entries
from checkpointengine.protocol import BucketReady, GroupInit, ProtocolError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BroadcastFields:
    """``broadcast_backend``: the group's torch.distributed backend, gloo | nccl (``auto`` resolved by
    the leader: nccl when CUDA is available)."""

    broadcast_backend: str = "gloo"


class BroadcastSender(BackendSender):
    def __init__(self, cfg, fields: BroadcastFields):
        super().__init__(cfg, fields)
        self.group: bc.WeightUpdateGroup | None = None
        self.members: list[str] = []

    @classmethod
    def create(cls, cfg) -> BroadcastSender:
        backend = cfg.group_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if cfg.curve:
            logger.warning("checkpointengine.curve protects the weight plane's control socket only: the "
                           "broadcast group's %s traffic and its rendezvous store on %s are not encrypted",
                           backend, cfg.host)
        return cls(cfg, BroadcastFields(backend))

    def before_begin(self, sender, rnd) -> None:
        """(Re-)form the group when the update's rollers differ from the group's."""
        members = sorted(rnd.active)
        if self.group is not None and members == self.members:
            return
        bc.destroy_group(self.group)
        self.group = None
        backend, world = self.fields.broadcast_backend, len(members) + 1
        store = bc.create_sender_store(self.cfg.host, 0, world, self.cfg.timeout_s)
        name = f"hflow-weights-{uuid.uuid4().hex[:12]}"
        for i, roller in enumerate(members):
            sender.control.send_to(roller, GroupInit(self.cfg.host, store.port, i + 1, world, name, backend))
        self.group = bc.create_sender_group(store, world, name, backend, self.cfg.timeout_s, self.cfg.host)
        self.members = members

    def full_body(self, sender, stream):
        def run(rnd) -> tuple[int, int]:
            pending: list = []
            index = total = 0
            for bucket in whole_buckets(sender, stream):
                entries = whole_entries(bucket)
                used = sum(e.nbytes for e in entries)
                sender.control.broadcast(rnd, BucketReady(rnd.weight_version, index, entries, used))
                works = bc.broadcast_tensors(self.group, [t.to(self.group.device) for _, t in bucket])
                for work in pending:  # the previous bucket finishes while this one was cast
                    work.wait()
                pending = works
                index += 1
                total += used
            for work in pending:
                work.wait()
            return index, total

        return run

    def close(self) -> None:
        bc.destroy_group(self.group)
        self.group = None


class BroadcastReceiver(BackendReceiver):
    def __init__(self, handle, device):
        super().__init__(handle, device)
        self.group: bc.WeightUpdateGroup | None = None

    def on_control(self, msg) -> bool:
        if not isinstance(msg, GroupInit):
            return False
        bc.destroy_group(self.group)
        self.group = bc.init_weights_update_group(msg.master_address, msg.master_port, msg.rank_offset,
                                                  msg.world_size, msg.group_name, msg.backend,
                                                  self.handle.timeout_s)
        return True

    def bucket_tensors(self, msg, frames, unpacker, copy, consumed):
        if self.group is None:
            raise ProtocolError(f"bucket {msg.index} of a broadcast update before the group was formed")
        entries = msg.entries
        out = bc.receive_tensors(self.group, [e.name for e in entries], [e.dtype for e in entries],
                                 [e.shape for e in entries])
        consumed()
        yield from out

    def close(self) -> None:
        bc.destroy_group(self.group)
        self.group = None


BROADCAST = register_backend("broadcast", WeightSyncBackend(BroadcastSender, BroadcastReceiver, BroadcastFields))
