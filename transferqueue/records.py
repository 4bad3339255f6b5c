"""Typed records that cross the TransferQueue's boundaries: errors, field schemas, batch metadata, the handle.

Everything here is plain data that msgpack can carry (``to_wire`` / ``from_wire``); nothing holds a tensor
except ``Batch``, which only ever lives inside one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from common.curve import CurveKeys

# ------------------------------------------------------------------------------------------- errors


class TQError(RuntimeError):
    """Base of every TransferQueue transport error."""


class Timeout(TQError):
    """A server did not answer within the request timeout."""


class Closed(TQError):
    """The client (or the server it talks to) has been closed."""


class Full(TQError):
    """A storage unit is at capacity. Raised inside the unit (sent to the client as a ``full`` error reply,
    which the client retries) and by a client put whose units stayed full for longer than its timeout
    (nothing of the put was kept)."""


class RemoteError(TQError):
    """A server rejected a request (malformed, unknown op, bad ids, ...); the message says why."""


class LimitExceeded(RemoteError, ValueError):
    """A request would take a TransferQueue server past one of its bounds: ``key`` names it (the config key
    ``transferqueue.<key>``), the message its value and what the request asked for. The server refused the
    whole request (nothing of it applied), keeps serving, and keeps everything it had accepted before.

    Raised inside the servers (a ValueError there, like every other bad request) and sent to the client as
    an error reply whose ``limit`` field carries ``key``; the client raises it again from that reply."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)

    def __reduce__(self):  # picklable with both arguments (Ray carries a worker's errors to the caller)
        return type(self), (self.key, self.args[0])


class ServerLost(TQError):
    """A TransferQueue server is gone: ``server`` names it (``index`` or ``storage unit K``). Raised by a
    client whose connection to it closed (or never opened) and stayed down while a request waited
    (``transport.LOST_AFTER_S``), and by ``TQServers.check`` for a server process that exited (with how
    it ended). The samples a lost storage unit held are gone: a job cannot go on without it."""

    def __init__(self, server: str, message: str):
        self.server = server
        super().__init__(message)

    def __reduce__(self):  # picklable with both arguments (Ray carries a worker's errors to the caller)
        return type(self), (self.server, self.args[0])


# ------------------------------------------------------------------------------------------ schemas


@dataclass
class FieldSchema:
    """What the index knows about one field of a partition: ``dtype`` name (``torch`` name without the
    prefix, or ``"object"`` for msgpack-encoded values) and ``shape`` per sample (without the batch
    dimension), or ``None`` once samples with different shapes were put (a variable-length field)."""

    dtype: str
    shape: list[int] | None

    @property
    def variable(self) -> bool:
        return self.shape is None


def chunk_sizes(total: int, num_chunks: int) -> list[int]:
    """Sizes of ``num_chunks`` contiguous, in-order chunks of ``total`` items, differing by at most one
    (the first ``total % num_chunks`` get one more): ``chunk_sizes(3, 4) == [1, 1, 1, 0]``.
    Raises ValueError for ``num_chunks < 1`` or ``total < 0``."""
    if num_chunks < 1 or total < 0:
        raise ValueError(f"chunk_sizes needs total >= 0 and num_chunks >= 1, got {total}, {num_chunks}")
    base, extra = divmod(total, num_chunks)
    return [base + (1 if i < extra else 0) for i in range(num_chunks)]


@dataclass
class BatchMeta:
    """The metadata of a batch: which samples, which fields, their tags — never tensor contents.

    ``sample_ids``: global sample ids (never reused, across partitions). ``tags``: one dict per sample
    (``uid``, ``min_weight_version``, ...). ``schemas``: field name -> FieldSchema. ``reason``: why the
    batch is empty (non-blocking or timed-out ``get_meta``), else ``""``.
    """

    partition: str
    sample_ids: list[int]
    fields: list[str]
    tags: list[dict] = field(default_factory=list)
    schemas: dict[str, FieldSchema] = field(default_factory=dict)
    task: str = ""
    reason: str = ""

    def __len__(self) -> int:
        return len(self.sample_ids)

    def chunk(self, num_chunks: int) -> list[BatchMeta]:
        """Split into ``num_chunks`` in-order pieces (sizes from ``chunk_sizes``; trailing ones may be empty)."""
        out, start = [], 0
        for size in chunk_sizes(len(self), num_chunks):
            out.append(self._slice(start, start + size))
            start += size
        return out

    def _slice(self, start: int, stop: int) -> BatchMeta:
        return BatchMeta(self.partition, self.sample_ids[start:stop], list(self.fields),
                         self.tags[start:stop], dict(self.schemas), self.task, self.reason)

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """Join metas of one partition in order; raises ValueError for mixed partitions or fields."""
        if not metas:
            raise ValueError("BatchMeta.concat needs at least one BatchMeta")
        first = metas[0]
        for m in metas[1:]:
            if m.partition != first.partition or m.fields != first.fields:
                raise ValueError(f"cannot concat metas of {m.partition}/{m.fields} and "
                                 f"{first.partition}/{first.fields}")
        return BatchMeta(first.partition, [i for m in metas for i in m.sample_ids], list(first.fields),
                         [t for m in metas for t in m.tags], dict(first.schemas), first.task)

    def to_wire(self) -> dict:
        """A msgpack-able dict (no deep copy: tags are passed through as they are)."""
        return {"partition": self.partition, "sample_ids": self.sample_ids, "fields": self.fields, "tags": self.tags,
                "schemas": {k: {"dtype": v.dtype, "shape": v.shape} for k, v in self.schemas.items()},
                "task": self.task, "reason": self.reason}

    @staticmethod
    def from_wire(d: dict) -> BatchMeta:
        schemas = {k: FieldSchema(**v) for k, v in d.get("schemas", {}).items()}
        return BatchMeta(d["partition"], list(d["sample_ids"]), list(d["fields"]), list(d.get("tags", [])),
                         schemas, d.get("task", ""), d.get("reason", ""))


FieldValue = torch.Tensor | list[torch.Tensor] | list[Any]


@dataclass(frozen=True)
class Consume:
    """Samples a put answers: ``sample_ids`` of ``partition``, marked consumed by ``task`` in the same index
    step that makes the put's fields ready (``TQClient.put``, ``MetadataIndex.notify``)."""

    partition: str
    sample_ids: Sequence[int]
    task: str

    def to_wire(self) -> dict:
        return {"partition": self.partition, "ids": [int(i) for i in self.sample_ids], "task": self.task}

    @staticmethod
    def from_wire(d: dict) -> Consume:
        """Raises ValueError unless ``d`` is a map of exactly ``partition``, ``ids`` (a list of ints), ``task``."""
        if not isinstance(d, dict) or set(d) != {"partition", "ids", "task"}:
            raise ValueError("consume must be a map of partition, ids and task")
        ids = d["ids"]
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise ValueError("consume ids must be a list of ints")
        return Consume(d["partition"], ids, d["task"])


@dataclass
class Batch:
    """Data of a batch, as ``get_data`` returns it: ``meta`` plus one value per field.

    A field whose samples all have the same shape is one writable tensor ``(batch, *shape)``; a
    variable-length field is a list of per-sample tensors (views into one buffer owned by the caller;
    pad with ``transferqueue.batching.pad_sequences``); an ``object`` field is a list of Python values.
    """

    meta: BatchMeta
    fields: dict[str, FieldValue]

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, name: str) -> FieldValue:
        return self.fields[name]

    def chunk(self, num_chunks: int) -> list[Batch]:
        """Split into ``num_chunks`` in-order pieces (see ``chunk_sizes``); tensors are views."""
        out, start = [], 0
        for size in chunk_sizes(len(self), num_chunks):
            stop = start + size
            out.append(Batch(self.meta._slice(start, stop), {k: v[start:stop] for k, v in self.fields.items()}))
            start = stop
        return out

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Join batches in order: tensors with ``torch.cat``, lists by extension."""
        meta = BatchMeta.concat([b.meta for b in batches])
        fields: dict[str, FieldValue] = {}
        for name, first in batches[0].fields.items():
            parts = [b.fields[name] for b in batches]
            fields[name] = torch.cat(parts) if isinstance(first, torch.Tensor) else [x for p in parts for x in p]
        return Batch(meta, fields)


@dataclass
class TQHandle:
    """Everything a worker needs to build a client: addresses, routing, keys. Small and serialisable.

    ``unit_nodes`` / ``index_node``: the node identity (host + boot id) of each server; a client on the
    same node uses the shared-memory path and the server's ``ipc://`` endpoint (``unit_local_addresses``,
    ``index_local_address``; ``""`` when it has none) instead of TCP. ``p2p_backend``: the units' device
    path (``""`` off, ``gloo``, ``nccl``). ``route_block``: samples ``[k*route_block, (k+1)*route_block)``
    live on unit ``k % N``.
    """

    index_address: str
    unit_addresses: list[str]
    unit_nodes: list[str]
    index_node: str = ""
    index_local_address: str = ""
    unit_local_addresses: list[str] = field(default_factory=list)
    route_block: int = 64
    shared_memory: bool = True
    shm_min_bytes: int = 64 * 1024
    request_timeout_s: float = 60.0
    curve: CurveKeys | None = None
    p2p_backend: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> TQHandle:
        d = dict(d)
        if d.get("curve") is not None:
            d["curve"] = CurveKeys(**d["curve"])
        return TQHandle(**d)


@dataclass
class IndexStats:
    """Counts the index exports (the controller turns them into Prometheus metrics).

    ``ready``: ``{partition: {"task|field,field": ready-and-unconsumed samples}}``; ``produced``: samples
    allocated; ``consumed``: ``{task: samples handed out}``; ``cleared``: samples removed; ``bytes_stored``:
    bytes reported by puts and not yet cleared; ``requests``: ``{op: [count, total_s, max_s]}``;
    ``waiting``: long-polls now parked; ``reserved_ids``: ids clients hold reserved (as counted against
    ``transferqueue.max_reserved_ids``).
    """

    num_samples: int
    produced: int
    consumed: dict[str, int]
    cleared: int
    bytes_stored: int
    ready: dict[str, dict[str, int]]
    partitions: dict[str, int]
    requests: dict[str, list[float]]
    waiting: int
    reserved_ids: int = 0
