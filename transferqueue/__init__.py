"""The data plane: metadata index, storage units, and the put/get client.

::

    controller ── start_transferqueue(cfg) ──> index process  (ids, fields, tags, consumption; ZMQ ROUTER)
        │ TQHandle (addresses, keys)          storage unit 0 … N-1 (tensor bytes as received; ZMQ ROUTER
        ▼                                                        + /dev/shm blocks on the same node)
    any worker: TQClient(handle)
        put(fields, partition, [ids], tags) ──tensors──> units ; ──ids/schemas/tags──> index
        get_meta(fields, batch_size, task, partition, sampler) <──ids/tags── index (long-poll)
        get_data(meta) <──tensors── units (one copy into the caller's own tensors)

The controller only ever sees ``BatchMeta``/``IndexStats``: ids, field names, schemas, tags, counts.
"""

from transferqueue.batching import pad_sequences
from transferqueue.client import TQClient
from transferqueue.launch import TQServers, start_transferqueue
from transferqueue.records import (
    Batch,
    BatchMeta,
    Closed,
    FieldSchema,
    Full,
    IndexStats,
    LimitExceeded,
    RemoteError,
    ServerLost,
    Timeout,
    TQError,
    TQHandle,
    chunk_sizes,
)
from transferqueue.samplers import register_sampler

__all__ = [
    "Batch", "BatchMeta", "Closed", "FieldSchema", "Full", "IndexStats", "LimitExceeded", "RemoteError", "ServerLost",
    "TQClient", "TQError", "TQHandle", "TQServers", "Timeout", "chunk_sizes", "pad_sequences", "register_sampler", "start_transferqueue",
]
