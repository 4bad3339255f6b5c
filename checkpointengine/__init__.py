"""The weight plane: versioned, bucketed weight transfer from trainers to rollers.

Send side (trainer ranks): ``WeightSender`` (``send`` full tensors, ``send_shards`` FSDP2 ``Shard(0)``
rows on one node), driven by ``trainers.weight_sync``. Receive side (rollers): ``WeightReceiver``,
driven by ``rollers.weight_update.apply_update``. The ``WeightSyncHandle`` made by the leader tells
every side where to meet. See ``protocol`` for the message flow, ``bucket`` for the bucket format and
``backend`` for the backends (typed plug-ins, one module each in ``backends/``, each subclassing the two
sides of ``backend_sides``). This package imports
neither ``trainers`` nor ``rollers``.

Modules: ``bucket`` (layout, packing, unpacking), ``naming`` (names, tied embeddings, dtype cast),
``protocol`` (messages, handle, errors), ``control`` (the leader's ZMQ control plane), ``storage`` (shm
slots, safetensors directories, one per ``weight_version``), ``broadcast`` (SGLang's weight-update group:
the ``broadcast`` backend's and the SGLang-API server's), ``backend`` (the registry) + ``backend_sides`` (the
sender and receiver sides a backend implements) + ``backends/`` (shm, zmq, broadcast, disk), ``sender``/``receiver``.
"""

from checkpointengine.bucket import RowShard, TensorEntry
from checkpointengine.naming import MissingWeightsError, WeightNameMapper
from checkpointengine.protocol import (
    WeightSyncAborted,
    WeightSyncError,
    WeightSyncHandle,
    WeightSyncTimeout,
)
from checkpointengine.receiver import WeightReceiver
from checkpointengine.sender import SyncReport, WeightSender

__all__ = [
    "MissingWeightsError", "RowShard", "SyncReport", "TensorEntry", "WeightNameMapper", "WeightReceiver",
    "WeightSender", "WeightSyncAborted", "WeightSyncError", "WeightSyncHandle", "WeightSyncTimeout",
]
