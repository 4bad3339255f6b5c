"""Driving an engine through one weight update: the rollers' side of the weight plane.

``paused_update``: pause(``pause_mode``) → apply the new weights → flush the prefix cache (not after an
``in_place`` pause, which keeps every key/value) → resume, resuming on failure too. ``apply_update`` runs it
with the checkpoint engine's receive (``checkpointengine.WeightReceiver``, in a worker thread) and
``load_weights`` (atomic: the engine commits the weight_version or keeps the old one) as the apply step, then
acks. ``RollerActor.update_weights`` calls ``apply_update`` for both engines; the trainer side sends meanwhile
(``trainers.weight_sync.send_weights``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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
    """Flush the prefix cache after a ``pause_mode`` pause (never after ``in_place``: ``paused_update``).
    After ``abort`` the aborted requests may still be draining (SGLang's abort is asynchronous), so the flush
    is retried while refused (``Engine.flush_cache_with_retry``) and a final refusal is an error. Requests
    kept by a ``retract`` pause make an engine refuse a flush until it resumes (SGLang does); their KV is
    recomputed on resume, so one refusal is logged and the flush skipped."""
    if pause_mode == "abort":
        await engine.flush_cache_with_retry()
        return
    try:
        await engine.flush_cache()
    except EngineError as exc:
        logger.warning("prefix cache not flushed after a %s pause: %s", pause_mode, exc)


async def paused_update(engine: Engine, apply: Callable[[], Awaitable[Any]], pause_mode: str = "retract") -> None:
    """pause(``pause_mode``) → ``await apply()`` (load the new weights) → flush the prefix cache (unless
    ``in_place``; :func:`_flush`) → resume. On any failure the engine is resumed (a failed resume is logged:
    the first error is the news) and the failure re-raised; ``load_weights`` being atomic, the engine then
    keeps its old weights and weight_version."""
    try:
        await engine.pause(pause_mode)
        await apply()
        if pause_mode != "in_place":  # in_place keeps every key/value by design (SGLang's too)
            await _flush(engine, pause_mode)
    except BaseException:
        try:
            await engine.resume()
        except Exception as resume_exc:  # the engine itself is broken; the update's error is the news
            logger.error("resume after a failed weight update failed: %s", resume_exc)
        raise
    await engine.resume()


async def apply_update(engine: Engine, receiver: WeightReceiver, weight_version: int, pause_mode: str = "retract"
                       ) -> UpdateResult:
    """Update ``engine`` to ``weight_version`` through ``receiver`` (a ``checkpointengine.WeightReceiver``):
    :func:`paused_update` whose apply step receives every bucket and loads them (``load_weights``), then ack.

    The receive runs in a worker thread (it blocks on the socket) so the engine's event loop keeps
    serving. On any failure the engine keeps its old weights and weight_version and is resumed, the error
    is reported to the sender, and WeightUpdateError is raised.
    """
    start = time.perf_counter()

    async def receive_and_load() -> None:
        tensors = await asyncio.to_thread(lambda: list(receiver.receive(weight_version)))
        await engine.load_weights(tensors, weight_version)

    try:
        await paused_update(engine, receive_and_load, pause_mode)
    except BaseException as exc:
        receiver.fail(weight_version, f"{type(exc).__name__}: {exc}")
        raise WeightUpdateError(receiver.roller, weight_version, receiver.weight_version, exc) from exc
    duration = time.perf_counter() - start
    receiver.ack(weight_version, duration)
    return UpdateResult(receiver.roller, weight_version, duration, receiver.stats()["last_bytes"])
