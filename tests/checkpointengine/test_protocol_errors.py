"""The weight plane's errors survive the trip from a trainer actor to the controller (Ray pickles an actor's
exception; one that cannot be rebuilt arrives as an opaque ``UnserializableException``)."""

from __future__ import annotations

import pickle

from checkpointengine.protocol import WeightSyncAborted, WeightSyncError, WeightSyncTimeout


def test_weight_sync_errors_rebuild_with_their_fields():
    err = WeightSyncError(3, {"roller0": "WeightSyncAborted: aborted by the sender"})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is WeightSyncError and str(back) == str(err)
    assert back.weight_version == 3 and back.failures == {"roller0": "WeightSyncAborted: aborted by the sender"}
    for cls in (WeightSyncTimeout, WeightSyncAborted):
        assert str(pickle.loads(pickle.dumps(cls("weight_version 3: late")))) == "weight_version 3: late"
