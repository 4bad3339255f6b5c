"""The two sides a weight-sync backend implements: ``BackendSender`` (one trainer rank) and ``BackendReceiver``
(one roller), the classes a ``WeightSyncBackend`` registers (``checkpointengine.backend``).

They speak in the control plane's terms (the config, the ``WeightSyncHandle``, a ``Round``, a ``BucketReady``),
all of which look backends up by name in ``checkpointengine.backend``; so these classes live here, above the
control plane, and the registry below it. A backend module subclasses both (``checkpointengine/backends/``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from checkpointengine.backend import NoFields
from checkpointengine.bucket import BucketUnpacker
from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.control import Round
from checkpointengine.protocol import BucketReady, WeightSyncHandle

if TYPE_CHECKING:
    from checkpointengine.sender import WeightSender

# An update's body on the leader, given the round: sends every bucket, returns (buckets, payload bytes).
Body = Callable[[Round], tuple[int, int]]


class BackendSender:
    """One trainer rank's side of a backend. ``fields``: the backend's handle fields (a dataclass).

    ``create`` (leader) makes the resources and the fields; ``attach`` (other ranks) joins them.
    ``full_body`` sends gathered full tensors (``(engine_name, tensor)``, already routed by the
    mapper); ``shard_body`` (only when the plug-in ``supports_shards``) has every rank write its rows.
    ``before_begin`` runs on the leader after every target's ``Want`` and before ``Begin`` (e.g. to
    form a group). ``close`` releases everything; idempotent.
    """

    def __init__(self, cfg: CheckpointEngineConfig, fields: Any):
        self.cfg = cfg
        self.fields = fields

    @classmethod
    def create(cls, cfg: CheckpointEngineConfig) -> BackendSender:
        return cls(cfg, NoFields())

    @classmethod
    def attach(cls, cfg: CheckpointEngineConfig, handle: WeightSyncHandle) -> BackendSender:
        return cls(cfg, handle.fields)

    def full_body(self, sender: WeightSender, stream: Iterator[tuple[str, torch.Tensor]]) -> Body:
        raise NotImplementedError

    def shard_body(self, sender: WeightSender, stream: Iterator, agree: Callable[[bool], bool] | None
                   ) -> Body:
        raise NotImplementedError(f"{type(self).__name__} has no shard path")

    def before_begin(self, sender: WeightSender, rnd: Round) -> None:
        return None

    def close(self) -> None:
        return None


class BackendReceiver:
    """One roller's side of a backend (``handle.fields`` are the backend's fields; tensors land on
    ``device``; ``pool``: the previous update's tensors to copy into, or None).

    ``on_control`` sees control messages that arrive before ``Begin`` (True = handled, e.g. a
    ``GroupInit``). ``bucket_tensors`` yields bucket ``msg``'s ``(engine_name, tensor)`` pairs and calls
    ``consumed()`` once the bucket's payload may be reused by the sender. ``close``: idempotent.
    """

    def __init__(self, handle: WeightSyncHandle, device: torch.device):
        self.handle = handle
        self.device = device

    def on_control(self, msg: Any) -> bool:
        return False

    def bucket_tensors(self, msg: BucketReady, frames: list, unpacker: BucketUnpacker, copy: bool,
                       consumed: Callable[[], None]) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def close(self) -> None:
        return None
