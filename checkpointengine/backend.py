"""Weight-sync backends as typed plug-ins: the interface and the one registry of their names.

A backend is how the bytes of an update travel once the control plane (``protocol``, ``control``) has
agreed on it: shared-memory slots, ZMQ frames, a broadcast group, safetensors files. Each one is a
``WeightSyncBackend`` registered under a name, carrying

* ``fields``: a dataclass of what the backend adds to the ``WeightSyncHandle`` (e.g. ``shm``'s slot
  paths), built by the leader's sender side and read by every other rank and roller;
* ``sender``: a ``BackendSender`` class, one trainer rank's side (leader: ``create``; other ranks:
  ``attach``), which turns the update's tensor stream into buckets on the wire;
* ``receiver``: a ``BackendReceiver`` class, one roller's side, which turns each ``BucketReady`` back
  into tensors;
* ``supports_shards``: whether every trainer rank may write its own ``Shard(0)`` rows
  (``WeightSender.send_shards``, one node) instead of sending gathered full tensors.

``WeightSender``/``WeightReceiver`` own the control plane and ask the plug-in; no call site compares a
backend's name. ``checkpointengine.backend`` in the config is validated against this registry.

Adding a backend: one module in ``checkpointengine/backends/`` that calls ``register_backend`` (every
module there is imported when a backend is first looked up), or a module of your own named as
``checkpointengine.backend=my_pkg.my_backend:name`` (imported by each process that resolves the name:
the controller, every trainer rank, every roller — so it must be importable there).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from common.registry import Registry

if TYPE_CHECKING:
    from checkpointengine.bucket import BucketUnpacker
    from checkpointengine.config import CheckpointEngineConfig
    from checkpointengine.control import Round
    from checkpointengine.protocol import BucketReady, WeightSyncHandle
    from checkpointengine.sender import WeightSender

# An update's body on the leader, given the round: sends every bucket, returns (buckets, payload bytes).
Body = Callable[["Round"], tuple[int, int]]


@dataclass(frozen=True)
class NoFields:
    """Handle fields of a backend that adds none."""


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


@dataclass(frozen=True)
class WeightSyncBackend:
    """A registered backend: its handle ``fields`` dataclass, its ``sender`` and ``receiver`` sides, and
    whether every trainer rank may write its own ``Shard(0)`` rows (``supports_shards``)."""

    sender: type[BackendSender]
    receiver: type[BackendReceiver]
    fields: type = NoFields
    supports_shards: bool = False

    def fields_from_dict(self, data: dict) -> Any:
        """The typed fields from ``to_dict``'s form; raises ValueError for unknown or missing fields."""
        names = {f.name for f in dataclasses.fields(self.fields)}
        if not isinstance(data, dict) or set(data) - names:
            raise ValueError(f"handle fields {data!r} do not match {self.fields.__name__} ({sorted(names)})")
        try:
            return self.fields(**data)
        except TypeError as exc:
            raise ValueError(f"handle fields {data!r}: {exc}") from exc


BACKENDS: Registry[WeightSyncBackend] = Registry("weight-sync backend", "checkpointengine.backend")


def register_backend(name: str, backend: WeightSyncBackend) -> WeightSyncBackend:
    """Register ``backend`` under ``name``; raises ValueError for a taken or malformed name."""
    return BACKENDS.register(name, backend)


_builtin_loaded = False


def _load_builtin() -> None:
    """Import every module of ``checkpointengine.backends`` once (each registers its backend)."""
    global _builtin_loaded
    if _builtin_loaded:
        return
    package = importlib.import_module("checkpointengine.backends")
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
    _builtin_loaded = True


def get_backend(spec: str, key: str = "checkpointengine.backend") -> WeightSyncBackend:
    """The backend named ``spec`` (a registered name or ``module:name``); raises ValueError naming
    ``key``, the value and the registered backends when there is none."""
    _load_builtin()
    return BACKENDS.get(spec, key)


def backend_names() -> list[str]:
    """Registered backend names, sorted (the built-ins included)."""
    _load_builtin()
    return BACKENDS.names()
