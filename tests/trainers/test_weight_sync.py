"""``trainers.weight_sync``: the trainer side of the weight plane, called by the trainer on its own worker
(no attribute attached from another package). One process, no process group: rank 0 alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpointengine import WeightSender, WeightSyncHandle
from checkpointengine.config import CheckpointEngineConfig
from common.models import ModelConfig, load_model
from trainers import weight_sync


def _worker():
    policy = load_model(ModelConfig(path="tiny"))
    return SimpleNamespace(policy=policy, weight_sender=None,
                           named_full_tensors=lambda: ((n, p.detach()) for n, p in policy.named_parameters()))


def test_sending_before_attach_names_the_missing_step():
    with pytest.raises(RuntimeError, match="call attach_sender first"):
        weight_sync.send_weights(_worker(), 1)


def test_attach_then_close_sets_and_clears_the_workers_own_slot():
    worker = _worker()
    handle = weight_sync.attach_sender(worker, CheckpointEngineConfig(backend="zmq", bucket_bytes=4096), ["r0"])
    try:
        assert isinstance(worker.weight_sender, WeightSender)
        assert WeightSyncHandle.from_dict(handle) == worker.weight_sender.handle
        weight_sync.add_roller(worker, "r1")
        assert weight_sync.sender_stats(worker)["roller_weight_versions"] == {}
        assert worker.weight_sender.rollers == ["r0", "r1"]
    finally:
        weight_sync.close_sender(worker)
    assert worker.weight_sender is None
    weight_sync.close_sender(worker)  # idempotent



def test_rank_0_hands_the_rollers_client_keys_on_the_configured_host():
    """With checkpointengine.curve the handle rank 0 returns (which the controller gives rollers through Ray)
    carries the server's public key and the client key pair, never the server's secret."""
    worker = _worker()
    cfg = CheckpointEngineConfig(backend="zmq", bucket_bytes=4096, host="127.0.0.2", curve=True)
    handle = weight_sync.attach_sender(worker, cfg, ["r0"])
    try:
        assert handle["control_address"].startswith("tcp://127.0.0.2:")
        keys = handle["curve"]
        assert keys["server_public"] and keys["client_public"] and keys["client_secret"]
        assert keys["server_secret"] == ""
    finally:
        weight_sync.close_sender(worker)
