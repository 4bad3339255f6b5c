"""Send-side functions run on every trainer rank through ``TrainerGroup.execute(fn, ...)``.

The trainer worker is used by duck typing (``policy``, ``named_local_shards()``, ``named_full_tensors()``),
so this package does not import ``trainers``. The controller drives::

    handle = group.execute(attach_sender, cfg.checkpointengine, roller_names)[0]   # collective
    ... each roller: WeightReceiver(WeightSyncHandle.from_dict(handle), name)
    group.execute(send_weights, version)      # concurrently with apply_update(...) on every roller
    group.execute(add_roller, "r7"); group.execute(send_weights, version, ["r7"])   # a joining roller

``send_weights`` uses ``send_shards`` (no gather) for ``shm`` and the gathered stream otherwise.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist

from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.naming import WeightNameMapper
from checkpointengine.protocol import WeightSyncHandle
from checkpointengine.sender import WeightSender

SENDER_ATTR = "weight_sender"


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_json(obj: dict | None) -> dict:
    """Rank 0's ``obj`` on every rank, as JSON bytes in a uint8 tensor (no pickle)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert obj is not None
        return obj
    data = json.dumps(obj).encode() if obj is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=_device())
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=_device())
    if obj is not None:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().numpy()))


def attach_sender(worker, cfg: CheckpointEngineConfig, rollers: list[str]) -> dict:
    """Collective: rank 0 creates a ``WeightSender`` for ``rollers`` (names mapped and checked against
    the policy's own parameters), the other ranks attach to its handle. Returns the handle as a dict."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sender = None
    if rank == 0:
        sender = WeightSender(cfg, rollers, mapper=WeightNameMapper.for_model(worker.policy))
    handle = _broadcast_json(sender.handle.to_dict() if sender is not None else None)
    if sender is None:
        sender = WeightSender(cfg, rank=rank, handle=WeightSyncHandle.from_dict(handle))
    setattr(worker, SENDER_ATTR, sender)
    return handle


def send_weights(worker, version: int, targets: list[str] | None = None) -> dict | None:
    """Collective: send the policy as ``version`` (to ``targets``, default every roller); the
    ``SyncReport`` as a dict on rank 0, None elsewhere. Raises as ``WeightSender.send``."""
    sender: WeightSender = getattr(worker, SENDER_ATTR)
    if sender.handle.backend == "shm":
        report = sender.send_shards(worker.named_local_shards(), version, targets)
    else:
        report = sender.send(worker.named_full_tensors(), version, targets)
    return dataclasses.asdict(report) if report is not None else None


def add_roller(worker, name: str) -> None:
    getattr(worker, SENDER_ATTR).add_roller(name)


def remove_roller(worker, name: str) -> None:
    getattr(worker, SENDER_ATTR).remove_roller(name)


def sender_stats(worker) -> dict:
    return getattr(worker, SENDER_ATTR).stats()


def close_sender(worker) -> None:
    sender = getattr(worker, SENDER_ATTR, None)
    if sender is not None:
        sender.close()
        setattr(worker, SENDER_ATTR, None)
