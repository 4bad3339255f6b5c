"""The weight plane: versioned, bucketed weight transfer from trainers to rollers.

Send side (trainer ranks): ``WeightSender`` (``send`` full tensors, ``send_shards`` FSDP2 ``Shard(0)``
rows on one node). Receive side (rollers): ``WeightReceiver`` and the ``apply_update`` driver. The
``WeightSyncHandle`` made by the leader tells every side where to meet. See ``protocol`` for the
message flow and ``bucket`` for the bucket format.

Modules: ``bucket`` (layout, packing, unpacking), ``naming`` (names, tied embeddings, dtype cast),
``protocol`` (messages, handle, errors), ``control`` (the leader's ZMQ control plane), ``storage`` (shm
slots, safetensors version dirs), ``broadcast`` (SGLang-compatible torch.distributed groups),
``sender``/``receiver``, ``trainer_hooks`` (for ``TrainerGroup.execute``), ``sglang_sync`` (pushing
to SGLang HTTP servers by broadcast or disk).
"""

from checkpointengine import trainer_hooks
from checkpointengine.bucket import RowShard, TensorEntry
from checkpointengine.naming import MissingWeightsError, WeightNameMapper
from checkpointengine.protocol import (
    WeightSyncAborted,
    WeightSyncError,
    WeightSyncHandle,
    WeightSyncTimeout,
)
from checkpointengine.receiver import UpdateResult, WeightReceiver, WeightUpdateError, apply_update
from checkpointengine.sender import SyncReport, WeightSender

__all__ = [
    "MissingWeightsError", "RowShard", "SyncReport", "TensorEntry", "UpdateResult", "WeightNameMapper",
    "WeightReceiver", "WeightSender", "WeightSyncAborted", "WeightSyncError", "WeightSyncHandle",
    "WeightSyncTimeout", "WeightUpdateError", "apply_update", "trainer_hooks",
]
