"""The glossary is in one place (docs/glossary.md) and the code is spelled by it (issue 19, item 5)."""

from __future__ import annotations

import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_glossary_page_holds_designs_names_and_the_disambiguations():
    text = (ROOT / "docs" / "glossary.md").read_text()
    for name in ("input_ids", "response_mask", "rollout_log_probs", "weight_version", "global_step", "rollout.n",
                 "max_staleness", "staleness", "hflow_queue_lag", "partition", "consumer task", "tiny_repeat",
                 "SGLangAPIError", "ProtocolError", "Full", "num_samples"):
        assert name in text, name


def test_partition_and_consumer_tasks_are_spelled_apart():
    from controller.layout import PARTITION, TRAIN_TASK
    from rollers.tq_channel import TQGroupChannel

    rollout_task = inspect.signature(TQGroupChannel).parameters["task"].default
    assert PARTITION not in (TRAIN_TASK, rollout_task)


def test_index_and_client_take_get_meta_arguments_in_one_order():
    from transferqueue.client import TQClient
    from transferqueue.index import MetadataIndex

    def order(fn):
        return [p for p in inspect.signature(fn).parameters if p != "self"][:6]

    assert order(MetadataIndex.get_meta) == order(TQClient.get_meta)


def test_public_names_say_weight_version():
    from controller.ledger import GroupLedger, staleness
    from rollers.actor import RollerActor

    assert "min_weight_version" in inspect.signature(staleness).parameters
    assert "weight_version" in inspect.signature(GroupLedger.synced).parameters
    for fn in (GroupLedger.synced, GroupLedger.rewind, RollerActor.update_weights):
        params = inspect.signature(fn).parameters
        assert "weight_version" in params and "version" not in params, fn.__qualname__


def test_the_weight_plane_says_weight_version():
    """Calls, records and wire messages of the checkpoint engine and its two sides (issue 19: bare
    ``version`` for ``weight_version``)."""
    import dataclasses

    from checkpointengine import protocol
    from checkpointengine.control import Round
    from checkpointengine.receiver import WeightReceiver
    from checkpointengine.sender import SyncReport, WeightSender
    from checkpointengine.storage import DiskVersions
    from controller.pool import RollerPool
    from rollers.weight_update import UpdateResult, WeightUpdateError, apply_update
    from trainers.weight_sync import send_weights

    calls = (WeightSender.send, WeightSender.send_shards, WeightReceiver.receive, WeightReceiver.ack,
             WeightReceiver.fail, DiskVersions.begin, DiskVersions.write_bucket, DiskVersions.finish,
             DiskVersions.weight_version_dir, protocol.WeightSyncError, apply_update, WeightUpdateError,
             send_weights, RollerPool.push_weights)
    for fn in calls:
        params = inspect.signature(fn).parameters
        assert "weight_version" in params and "version" not in params, fn.__qualname__
    records = [cls for cls in protocol.MESSAGES.values()  # those about no update: no weight_version at all
               if cls not in (protocol.GroupInit, protocol.Hello, protocol.Probe)]
    assert not dataclasses.fields(protocol.Hello) and not dataclasses.fields(protocol.Probe)
    for cls in (*records, Round, SyncReport, UpdateResult):
        names = [f.name for f in dataclasses.fields(cls)]
        assert "weight_version" in names and "version" not in names, cls.__qualname__
    assert "initial_weight_version" in inspect.signature(WeightReceiver).parameters
    assert isinstance(WeightSender.weight_version, property) and not hasattr(WeightSender, "version")
