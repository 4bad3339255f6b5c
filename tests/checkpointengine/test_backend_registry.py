"""Weight-sync backends as typed plug-ins: the registry is the one list of names, each backend carries
its own handle fields, and a backend from outside the package (``module:name``) works end to end."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from checkpointengine import WeightReceiver, WeightSender, WeightSyncHandle
from checkpointengine.backend import backend_names, get_backend
from checkpointengine.config import CheckpointEngineConfig

PLUGIN = "tests.checkpointengine.plugin_backend:frames"
NAMED = [("model.w", torch.arange(600.0).view(20, 30)), ("model.ids", torch.arange(5)),
         ("model.h", torch.randn(7, generator=torch.Generator().manual_seed(0)).half()), ("model.e", torch.empty(0))]


def test_config_validates_against_the_registry_and_lists_its_names():
    assert {"shm", "zmq", "broadcast", "disk"} <= set(backend_names())
    with pytest.raises(ValueError, match=r"checkpointengine.backend='nfs' is not one of ") as refused:
        CheckpointEngineConfig(backend="nfs")
    assert str(backend_names()) in str(refused.value)  # every registered name, a backend added later too
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        CheckpointEngineConfig(backend="no_such_module:x")
    assert get_backend("shm").supports_shards and not get_backend("zmq").supports_shards


@pytest.mark.parametrize("backend, fields", [("shm", {"shm_paths", "node"}), ("zmq", set()),
                                             ("broadcast", {"broadcast_backend"}), ("disk", {"disk_dir"})])
def test_handle_carries_only_its_backends_typed_fields(backend, fields, tmp_path):
    cfg = CheckpointEngineConfig(backend=backend, bucket_bytes=1024, disk_dir=str(tmp_path), group_backend="gloo")
    sender = WeightSender(cfg, ["r0"])
    try:
        wire = sender.handle.to_dict()
        assert set(wire["fields"]) == fields
        assert not {"shm_paths", "disk_dir", "broadcast_backend"} & set(wire)  # no flat bag of every backend
        back = WeightSyncHandle.from_dict(wire)
        assert back == sender.handle and type(back.fields) is type(sender.handle.fields)
        with pytest.raises(ValueError, match="do not match"):
            WeightSyncHandle.from_dict({**wire, "fields": {**wire["fields"], "no_such_field": 1}})
    finally:
        sender.close()


def test_send_shards_needs_a_backend_that_supports_shards():
    sender = WeightSender(CheckpointEngineConfig(backend="zmq", bucket_bytes=1024), ["r0"])
    try:
        with pytest.raises(ValueError, match="send_shards needs a checkpointengine.backend that supports shards"):
            sender.send_shards([], 1)
    finally:
        sender.close()


def test_a_backend_from_outside_the_package_by_module_name():
    cfg = CheckpointEngineConfig(backend=PLUGIN, bucket_bytes=1024, timeout_s=20.0, dtype="bfloat16")
    sender = WeightSender(cfg, ["r0"])
    receiver = WeightReceiver(WeightSyncHandle.from_dict(sender.handle.to_dict()), "r0")
    got, errors = {}, []

    def roll():
        try:
            got.update(receiver.receive(1))
            receiver.ack(1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=roll, daemon=True)
    thread.start()
    try:
        report = sender.send(NAMED, 1)
        thread.join(timeout=20)
    finally:
        receiver.close()
        sender.close()
    assert not errors and report.acked == ["r0"] and report.num_buckets == 2
    assert dataclasses.asdict(receiver.handle.fields) == {"tag": "frames-v1"}
    for name, tensor in NAMED:
        expect = tensor.bfloat16() if tensor.is_floating_point() else tensor
        assert got[name].dtype == expect.dtype and torch.equal(got[name], expect), name


def test_shm_weights_stay_on_the_trainers_node():
    """A roller on another node (common.node.node_id: its Ray node in a Ray cluster) cannot map the leader's
    slot files: it is refused with what to use instead, not left to fail on a missing file."""
    from common.node import node_id

    sender = WeightSender(CheckpointEngineConfig(backend="shm", bucket_bytes=1024), ["r0"])
    try:
        wire = sender.handle.to_dict()
        assert wire["fields"]["node"] == node_id()
        WeightReceiver(WeightSyncHandle.from_dict(wire), "r0").close()  # same node: maps the slots
        elsewhere = {**wire, "fields": {**wire["fields"], "node": "ray:0123"}}
        with pytest.raises(ValueError, match="this roller is on node .* and the trainer on ray:0123: use "
                                             "checkpointengine.backend=zmq"):
            WeightReceiver(WeightSyncHandle.from_dict(elsewhere), "r0")
    finally:
        sender.close()
