"""Driving an engine through one weight update: the rollers' side of the weight plane.

``apply_update``: pause(``pause_mode``) → receive every bucket (``checkpointengine.WeightReceiver``, in a
worker thread) → ``load_weights`` (atomic: the engine commits the weight_version or keeps the old one) →
flush the prefix cache (not after an ``in_place`` pause, which keeps every key/value) → resume → ack.
``RollerActor.update_weights`` calls it; the trainer side sends meanwhile (``trainers.weight_sync.send_weights``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from checkpointengine.receiver import WeightReceiver
from rollers.engine import Engine, EngineError

logger = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A roller's update failed; it keeps ``kept_weight_version``. The cause is chained."""

    def __init__(self, roller: str, weight_version: int, kept_weight_version: int, cause: BaseException):
        self.roller, self.weight_version, self.kept_weight_version = roller, weight_version, kept_weight_version
        super().__init__(f"roller {roller!r}: update to weight_version {weight_version} failed, keeping "
                         f"{kept_weight_version}: {type(cause).__name__}: {cause}")


@dataclass
class UpdateResult:
    roller: str
    weight_version: int
    duration_s: float
    num_bytes: int


async def _flush(engine: Engine, pause_mode: str) -> None:
    """Flush the prefix cache (never after an ``in_place`` pause: ``apply_update``). Requests kept by a
    ``retract`` pause can make an engine refuse a flush (SGLang does); their KV is recomputed on resume, so
    the flush is skipped with a warning then. After an ``abort`` pause a refusal is an error."""
    try:
        await engine.flush_cache()
    except EngineError as exc:
        if pause_mode == "abort":
            raise
        logger.warning("prefix cache not flushed after a %s pause: %s", pause_mode, exc)


async def apply_update(engine: Engine, receiver: WeightReceiver, weight_version: int, pause_mode: str = "retract"
                       ) -> UpdateResult:
    """Update ``engine`` to ``weight_version`` through ``receiver`` (a ``checkpointengine.WeightReceiver``):
    pause(``pause_mode``) → receive and load every bucket → commit the weight_version → flush the prefix
    cache (unless ``in_place``) → resume → ack.

    The receive runs in a worker thread (it blocks on the socket) so the engine's event loop keeps
    serving. On any failure the engine keeps its old weights and weight_version (``load_weights`` is
    atomic), is resumed, the error is reported to the sender, and WeightUpdateError is raised.
    """
    start = time.perf_counter()
    try:
        await engine.pause(pause_mode)
        tensors = await asyncio.to_thread(lambda: list(receiver.receive(weight_version)))
        await engine.load_weights(tensors, weight_version)
        if pause_mode != "in_place":  # in_place keeps every key/value by design (SGLang's too)
            await _flush(engine, pause_mode)
    except BaseException as exc:
        receiver.fail(weight_version, f"{type(exc).__name__}: {exc}")
        try:
            await engine.resume()
        except Exception as resume_exc:  # the engine itself is broken; the update error is the news
            logger.error("roller %s: resume after a failed update failed: %s", receiver.roller, resume_exc)
        raise WeightUpdateError(receiver.roller, weight_version, receiver.weight_version, exc) from exc
    await engine.resume()
    duration = time.perf_counter() - start
    receiver.ack(weight_version, duration)
    return UpdateResult(receiver.roller, weight_version, duration, receiver.stats()["last_bytes"])
