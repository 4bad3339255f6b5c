"""Weight-sync backends as typed plug-ins: the one registry of their names.

A backend is how the bytes of an update travel once the control plane (``protocol``, ``control``) has
agreed on it: shared-memory slots, ZMQ frames, a broadcast group, safetensors files. Each one is a
``WeightSyncBackend`` registered under a name, carrying

* ``fields``: a dataclass of what the backend adds to the ``WeightSyncHandle`` (e.g. ``shm``'s slot
  paths), built by the leader's sender side and read by every other rank and roller;
* ``sender``: a ``BackendSender`` class (``checkpointengine.backend_sides``), one trainer rank's side
  (leader: ``create``; other ranks: ``attach``), which turns the update's tensor stream into buckets on
  the wire;
* ``receiver``: a ``BackendReceiver`` class (``checkpointengine.backend_sides``), one roller's side, which
  turns each ``BucketReady`` back into tensors;
* ``supports_shards``: whether every trainer rank may write its own ``Shard(0)`` rows
  (``WeightSender.send_shards``, one node) instead of sending gathered full tensors.

``WeightSender``/``WeightReceiver`` own the control plane and ask the plug-in; no call site compares a
backend's name. ``checkpointengine.backend`` in the config is validated against this registry and a
``WeightSyncHandle`` finds its backend here, so this module sits below the config and the control plane;
the two sides, which speak in their terms, sit above them.

Adding a backend: one module in ``checkpointengine/backends/`` that subclasses the two sides and calls
``register_backend`` (every module there is imported when a backend is first looked up), or a module of
your own named as ``checkpointengine.backend=my_pkg.my_backend:name`` (imported by each process that
resolves the name: the controller, every trainer rank, every roller — so it must be importable there).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from common.registry import Registry


@dataclass(frozen=True)
class NoFields:
    """Handle fields of a backend that adds none."""


@dataclass(frozen=True)
class WeightSyncBackend:
    """A registered backend: its handle ``fields`` dataclass, its ``sender`` and ``receiver`` sides, and
    whether every trainer rank may write its own ``Shard(0)`` rows (``supports_shards``)."""

    # Classes of ``checkpointengine.backend_sides``, which imports the config and the control plane; they
    # import this registry, so naming the sides' types here would close a cycle.
    sender: type  # a BackendSender subclass
    receiver: type  # a BackendReceiver subclass
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
