"""``rollers.weight_update.apply_update``: the engine side of a weight update, on the rollers' side of the
seam (it may name ``EngineError``, so only an engine's refusal to flush is tolerated after a pause that
keeps requests; any other error fails the update and the engine keeps its version)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from rollers.engine import EngineError
from rollers.weight_update import WeightUpdateError, apply_update

TENSORS = [("model.w", torch.ones(2, 3))]


class FakeReceiver:
    """The ``WeightReceiver`` surface ``apply_update`` uses, recording ack/fail."""

    roller = "r0"

    def __init__(self):
        self.weight_version, self.outcomes = 0, []

    def receive(self, weight_version):
        return iter(TENSORS)

    def ack(self, weight_version, duration_s=0.0):
        self.weight_version = weight_version
        self.outcomes.append(("ack", weight_version))

    def fail(self, weight_version, error):
        self.outcomes.append(("fail", weight_version, error))

    def stats(self):
        return {"last_bytes": 24}


class FakeEngine:
    def __init__(self, flush_error: BaseException | None):
        self.flush_error, self.calls, self.weight_version = flush_error, [], 0

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def load_weights(self, tensors, weight_version):
        self.calls.append(("load", [n for n, _ in tensors], weight_version))
        self.weight_version = weight_version

    async def flush_cache(self):
        self.calls.append(("flush",))
        if self.flush_error is not None:
            raise self.flush_error

    async def flush_cache_with_retry(self):  # Engine's: retried while aborted requests drain (SGLang)
        self.calls.append(("flush_with_retry",))
        if self.flush_error is not None:
            raise self.flush_error

    async def resume(self):
        self.calls.append(("resume",))


def test_engine_refusing_a_flush_after_retract_is_a_warning(caplog):
    engine, receiver = FakeEngine(EngineError("requests hold KV cache")), FakeReceiver()
    with caplog.at_level(logging.WARNING, logger="rollers.weight_update"):
        result = asyncio.run(apply_update(engine, receiver, 1, "retract"))
    assert (result.weight_version, result.num_bytes) == (1, 24) and receiver.outcomes == [("ack", 1)]
    assert engine.calls == [("pause", "retract"), ("load", ["model.w"], 1), ("flush",), ("resume",)]
    assert "prefix cache not flushed after a retract pause" in caplog.text


def test_an_in_place_update_does_not_flush():
    """in_place keeps every key/value by design (SGLang's does too): no flush to refuse or to drop them."""
    engine, receiver = FakeEngine(EngineError("requests hold KV cache")), FakeReceiver()
    result = asyncio.run(apply_update(engine, receiver, 1, "in_place"))
    assert result.weight_version == 1 and receiver.outcomes == [("ack", 1)]
    assert engine.calls == [("pause", "in_place"), ("load", ["model.w"], 1), ("resume",)]


def test_any_other_flush_error_fails_the_update():
    """A plain RuntimeError is not an engine's refusal: the update fails, is reported, the engine resumes."""
    engine, receiver = FakeEngine(RuntimeError("CUDA error: illegal memory access")), FakeReceiver()
    with pytest.raises(WeightUpdateError, match="illegal memory access") as info:
        asyncio.run(apply_update(engine, receiver, 1, "retract"))
    assert info.value.kept_weight_version == 0 and receiver.weight_version == 0
    assert receiver.outcomes[0][:2] == ("fail", 1) and engine.calls[-1] == ("resume",)


def test_a_refused_flush_after_abort_fails_the_update():
    engine, receiver = FakeEngine(EngineError("requests hold KV cache")), FakeReceiver()
    with pytest.raises(WeightUpdateError, match="KV cache"):
        asyncio.run(apply_update(engine, receiver, 1, "abort"))
    assert receiver.outcomes[0][:2] == ("fail", 1)
    assert engine.calls == [("pause", "abort"), ("load", ["model.w"], 1), ("flush_with_retry",), ("resume",)]
