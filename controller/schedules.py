"""The schedules: each a registered class that declares what it is and runs a short loop of named stages
(``controller.stages.Stages``) over the pools of ``controller.runtime``.

::

    sync          admit(B) → generate(B) → update → sync_weights                       (staleness 0)

    one-step-off  admit(B₀) → generate(B₀)
                  loop k:  admit(B_{k+1}) ┐ rollers generate B_{k+1} with v_k
                           update(B_k)    ┘ meanwhile the trainer trains on B_k
                           sync_weights (v_{k+1}) once both are done               (staleness exactly 1)

    fully-async   admitter task: admit while started − released ≤ (max_staleness + v + 1)·B − 1
                  loop:    generate(B · require_batches) as soon as complete groups are ready
                           (stale_policy on groups staler than max_staleness) → update
                           → sync_weights every trigger_sync_steps, in-flight requests paused and
                             resumed (partial rollout)                                (≤ max_staleness)

What a schedule declares (class attributes; every other module asks these, never compares ``mode``):

* ``bounded``: admission follows the staleness bound of ``controller.ledger`` (else the loop's structure
  bounds staleness and admission only counts);
* ``overlapping``: generation overlaps the update (the pools' threads share the cores,
  ``controller.resources``); ``trainer_takes_every_core``: the trainer's ``auto`` threads take every core,
  the rollers' on top (else the cores are split);
* ``replaces_failed``: a group that failed (``rollers.on_failed_group=skip``) gives its slot to a fresh prompt
  and the step waits for it (else the step trains fewer groups);
* ``batches_per_step(algorithm)``: batches of ``data.train_batch_size`` groups one step trains;
* ``can_be_stale(algorithm)``: whether a trained sample can come from older weights.

A new schedule is one class registered with ``@register_schedule`` (in a module of its own, ``mode=module:name``
for one outside the package) whose ``run(st)`` is written in the stages of ``Stages``.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from common.registry import Registry

POLL_S = 0.5  # how long an admitter waits for a change before it looks again


class Schedule:
    """One schedule: its declarations (module docstring) and its loop, ``run``."""

    name: ClassVar[str]
    bounded: ClassVar[bool] = False
    overlapping: ClassVar[bool] = False
    trainer_takes_every_core: ClassVar[bool] = False
    replaces_failed: ClassVar[bool] = False

    @staticmethod
    def batches_per_step(algorithm) -> int:
        """Batches of ``data.train_batch_size`` prompt groups one trainer step trains (``algorithm``: the
        ``AlgorithmConfig``)."""
        return 1

    @staticmethod
    def can_be_stale(algorithm) -> bool:
        """Whether a trained sample can come from weights older than the trainer's."""
        return False

    @classmethod
    def groups_per_step(cls, cfg) -> int:
        """Prompt groups one trainer step trains (``cfg``: the ``HFlowConfig``)."""
        return cfg.data.train_batch_size * cls.batches_per_step(cfg.algorithm)

    @staticmethod
    async def run(st) -> None:
        """Train from ``st``'s step to ``trainer.total_steps`` (``st``: ``controller.stages.Stages``)."""
        raise NotImplementedError


SCHEDULES: Registry[type[Schedule]] = Registry("schedule", "mode")


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Class decorator: register ``cls`` under ``cls.name``."""
    SCHEDULES.register(cls.name, cls)
    return cls


async def _first_batch(st, batch_size: int, train_weight_version: int):
    """Admit and generate one batch; after a resume or a trainer restart, the groups already outstanding are
    part of it."""
    ahead = st.ledger.outstanding
    fed = min(batch_size, ahead) + await st.admit(batch_size - ahead, bounded=False)
    return await st.generate(fed, train_weight_version=train_weight_version)


@register_schedule
class Sync(Schedule):
    name = "sync"

    @staticmethod
    async def run(st) -> None:
        B = st.cfg.data.train_batch_size
        for _ in range(st.ledger.step, st.cfg.trainer.total_steps):
            meta = await _first_batch(st, B, st.ledger.weight_version)
            await st.update(meta)
            await st.sync_weights()


@register_schedule
class OneStepOff(Schedule):
    name = "one-step-off"
    overlapping = True

    @staticmethod
    def can_be_stale(algorithm) -> bool:
        return True

    @staticmethod
    async def run(st) -> None:
        B, total = st.cfg.data.train_batch_size, st.cfg.trainer.total_steps
        if st.ledger.step >= total:
            return
        meta = await _first_batch(st, B, st.ledger.weight_version)
        for step in range(st.ledger.step, total):
            pending = None
            if step < total - 1:  # batch k+1: generated with v_k while the trainer trains on batch k
                ahead = st.ledger.outstanding - st.num_groups(meta)  # of batch k+1, admitted already
                fed = min(B, ahead) + await st.admit(B - ahead, bounded=False)
                pending = asyncio.ensure_future(st.generate(fed, train_weight_version=st.ledger.weight_version + 1))
            try:
                await st.update(meta)
                meta = await pending if pending is not None else None
            finally:
                if pending is not None and not pending.done():
                    pending.cancel()
            await st.sync_weights()


@register_schedule
class FullyAsync(Schedule):
    name = "fully-async"
    bounded = True
    overlapping = True
    trainer_takes_every_core = True
    replaces_failed = True

    @staticmethod
    def batches_per_step(algorithm) -> int:
        return algorithm.require_batches

    @staticmethod
    def can_be_stale(algorithm) -> bool:
        return algorithm.max_staleness >= 1

    @staticmethod
    async def run(st) -> None:
        per_step = st.groups_per_step
        admitter = asyncio.ensure_future(FullyAsync.keep_admitting(st))
        try:
            for step in range(st.ledger.step, st.cfg.trainer.total_steps):
                need = per_step if not st.ledger.exhausted else min(per_step, st.ledger.outstanding)
                meta = await st.generate(need, train_weight_version=st.ledger.weight_version, enforce_staleness=True)
                await st.update(meta)
                last = step == st.cfg.trainer.total_steps - 1
                if st.ledger.weight_version % st.cfg.algorithm.trigger_sync_steps == 0 or last:
                    await st.sync_weights(wait_validation=False)  # validation overlaps training
                if admitter.done():
                    admitter.result()  # re-raise an admission error
        finally:
            st.ledger.close()
            st.changed.set()
            await asyncio.wait({admitter}, timeout=10 * POLL_S)
            admitter.cancel()
            await asyncio.gather(admitter, return_exceptions=True)

    @staticmethod
    async def keep_admitting(st) -> None:
        """Admit prompt groups whenever the staleness bound allows (woken by syncs and drops)."""
        while not (st.ledger.exhausted or st.ledger.closed):
            st.changed.clear()
            await st.admit(st.total_groups)
            try:
                async with asyncio.timeout(POLL_S):
                    await st.changed.wait()
            except TimeoutError:
                pass
