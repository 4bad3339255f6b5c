"""The trainer side of the weight plane: run on every trainer rank through ``TrainerGroup.execute``.

Each function takes the rank's ``TrainerWorker`` (its ``policy``, ``named_local_shards()``,
``named_full_tensors()`` and the ``weight_sender`` slot it declares) and is collective. The controller
drives::

    handle = group.execute(attach_sender, cfg.checkpointengine, roller_names)[0]   # collective
    ... each roller: WeightReceiver(WeightSyncHandle.from_dict(handle), name)
    group.execute(send_weights, weight_version)      # concurrently with apply_update(...) on every roller
    group.execute(add_roller, "r7"); group.execute(send_weights, weight_version, ["r7"])   # a joining roller

``send_weights`` uses ``send_shards`` (no gather) when the backend supports it (``shm``) and the gathered
stream otherwise.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.naming import WeightNameMapper
from checkpointengine.protocol import WeightSyncHandle
from checkpointengine.sender import WeightSender
from trainers.collectives import broadcast_json


def attach_sender(worker, cfg: CheckpointEngineConfig, rollers: list[str]) -> dict:
    """Collective: rank 0 creates a ``WeightSender`` for ``rollers`` (names mapped and checked against
    the policy's own parameters), the other ranks attach to its handle. Returns the handle as a dict:
    on rank 0 the rollers' handle (with ``checkpointengine.curve``, the client keys the controller hands
    to rollers through Ray), elsewhere the ranks' copy, which never carries keys."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sender = None
    if rank == 0:
        sender = WeightSender(cfg, rollers, mapper=WeightNameMapper.for_model(worker.policy))
    shared = broadcast_json(sender.handle_for_ranks().to_dict() if sender is not None else None)
    if sender is None:
        sender = WeightSender(cfg, rank=rank, handle=WeightSyncHandle.from_dict(shared))
    worker.weight_sender = sender
    return sender.handle.to_dict() if rank == 0 else shared


def _sender(worker) -> WeightSender:
    if worker.weight_sender is None:
        raise RuntimeError("no weight sender on this trainer rank: call attach_sender first")
    return worker.weight_sender


def send_weights(worker, weight_version: int, targets: list[str] | None = None) -> dict | None:
    """Collective: send the policy as ``weight_version`` (to ``targets``, default every roller); the
    ``SyncReport`` as a dict on rank 0, None elsewhere. Raises as ``WeightSender.send``."""
    sender = _sender(worker)
    if sender.supports_shards:
        report = sender.send_shards(worker.named_local_shards(), weight_version, targets)
    else:
        report = sender.send(worker.named_full_tensors(), weight_version, targets)
    return dataclasses.asdict(report) if report is not None else None


def add_roller(worker, name: str) -> None:
    _sender(worker).add_roller(name)


def remove_roller(worker, name: str) -> None:
    _sender(worker).remove_roller(name)


def sender_stats(worker) -> dict:
    return _sender(worker).stats()


def close_sender(worker) -> None:
    sender, worker.weight_sender = worker.weight_sender, None
    if sender is not None:
        sender.close()
