"""Validation during training: held-out prompts evaluated on the rollers through the TransferQueue.

::

    sync_weights (v) ──> Validator.maybe_start(v): feeder.feed_validation(round) ──put──> "validation_prompts"
                                                                                                  │
    rollers: take a validation prompt row before any training one; put its samples (greedy last) ─┘
             into partition "validation" ─────────────────────────────────────────────────────┐
                                                                                              │
    Validator's collector ──get_meta(task "validate", group_complete)── tags only ──> record ─┘
        └─> metrics.jsonl (``"validation": true``), Prometheus, trackers, summary (first/best/last), plot

A round is every held-out prompt (``data.val_size``, ``controller.data.load_split``) as one group of
``val.n`` samples at ``rollout.temperature`` plus, with ``val.greedy``, one greedy sample. Rounds start
after the weight sync that makes version v current on every roller when v is 0 (``val.before_train``), a
multiple of ``trainer.val_every`` or the last step; a round names that ``weight_version``. Validation
groups are not admitted through the staleness bound (``controller.ledger``) and never reach the
trainer (its task is ``train`` on another partition), so they neither count against the bound nor change
what is trained. ``sync`` and ``one-step-off`` wait for a round before the next weight sync, so every
validation sample is single-version; ``fully-async`` does not wait (training is not paused): a round
that spans a sync reports its ``val/multi_version_samples`` and ``val/weight_version_max``.

The controller reads only tags (reward, greedy, response length, finish reason, weight versions).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from common import schema
from controller.config import HFlowConfig

logger = logging.getLogger(__name__)

VAL_PARTITION = "validation"  # the TransferQueue partition of validation samples
VAL_PROMPT_PARTITION = "validation_prompts"  # their prompt rows (one per group), put by the feeder
VAL_TASK = "validate"  # the consumer task that reads them (the trainer's is "train", on another partition)
VAL_FIELDS = list(schema.VALIDATION.read_fields())  # a group is ready when these are; the collector reads tags only
CORRECT = 0.999  # as controller.schedules: a sample is correct when its reward reaches this
POLL_S = 0.5


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples: 1 − C(n−c, k) / C(n, k)
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1). Raises ValueError
    unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_k_values(n: int) -> list[int]:
    """The k of the pass@k a round reports: 1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def validation_record(tags: list[dict], weight_version: int, n: int) -> dict:
    """The metrics of one round from its samples' tags (``reward``, ``greedy``, ``uid``,
    ``response_length``, ``finish_reason``, ``min/max_weight_version``); ``n``: sampled samples per
    prompt (``val.n``). Sampled metrics average over prompts with all ``n`` samples; ``val/accuracy`` is
    pass@1. Raises ValueError without any sample."""
    if not tags:
        raise ValueError("a validation round without samples")
    sampled = [t for t in tags if not t.get(schema.GREEDY)]
    greedy = [t for t in tags if t.get(schema.GREEDY)]
    by_uid: dict[str, list[float]] = {}
    for t in sampled:
        by_uid.setdefault(t[schema.UID], []).append(float(t[schema.REWARD]))
    groups = [g for g in by_uid.values() if len(g) == n]
    record: dict = {"validation": True, "step": weight_version, "weight_version": weight_version,
                    "val/num_prompts": len({t[schema.UID] for t in tags}), "val/num_samples": len(tags)}
    if groups:
        for k in pass_k_values(n):
            record[f"val/pass@{k}"] = sum(pass_at_k(n, sum(r >= CORRECT for r in g), k) for g in groups) / len(groups)
        record["val/accuracy"] = record["val/pass@1"]
        record["val/reward_mean"] = sum(sum(g) / n for g in groups) / len(groups)
    if greedy:
        rewards = [float(t[schema.REWARD]) for t in greedy]
        record["val/accuracy_greedy"] = sum(r >= CORRECT for r in rewards) / len(rewards)
        record["val/reward_mean_greedy"] = sum(rewards) / len(rewards)
    lengths = [int(t[schema.RESPONSE_LENGTH]) for t in sampled or greedy]
    record["val/response_length_mean"] = sum(lengths) / len(lengths)
    record["val/response_clip_ratio"] = (sum(t[schema.FINISH_REASON] == "length" for t in sampled or greedy)
                                         / len(lengths))
    record["val/multi_version_samples"] = sum(t[schema.MIN_WEIGHT_VERSION] != t[schema.MAX_WEIGHT_VERSION]
                                              for t in tags)
    record["val/weight_version_min"] = min(t[schema.MIN_WEIGHT_VERSION] for t in tags)
    record["val/weight_version_max"] = max(t[schema.MAX_WEIGHT_VERSION] for t in tags)
    return record


@dataclass
class _Round:
    index: int
    weight_version: int
    uids: set[str]
    started: float = field(default_factory=time.monotonic)
    metas: list = field(default_factory=list)
    num_failed_groups: int = 0


class Validator:
    """Starts validation rounds and collects them (one background collector task, owned here).

    ``rt``: the job's ``Runtime``; ``on_record(record)``: called with each finished round's record
    (metrics.jsonl, Prometheus, trackers); ``check_rollers()``: ``Stages.check_rollers`` (raises a
    roller's error; routes failed validation groups to ``on_failed``); ``dump(meta, kind, step,
    weight_version)``: writes the decoded samples of a round when due (``controller.generations``).
    """

    def __init__(self, cfg: HFlowConfig, rt, on_record: Callable[[dict], None],
                 check_rollers: Callable[[], Awaitable[int]], dump=None):
        self.cfg, self.rt, self.on_record = cfg, rt, on_record
        self.check_rollers, self.dump = check_rollers, dump
        self.enabled = cfg.data.val_size > 0
        self.group_size = cfg.val.n + int(cfg.val.greedy)
        self.records: list[dict] = []
        self._rounds: dict[int, _Round] = {}  # in flight, by round index
        self._versions: set[int] = set()  # weight versions with a round started
        self._collector: asyncio.Task | None = None

    def due(self, weight_version: int) -> bool:
        """Whether version ``weight_version`` gets a round (see the module docstring; once per version)."""
        if not self.enabled or weight_version in self._versions:
            return False
        if weight_version == 0:
            return self.cfg.val.before_train
        every = self.cfg.trainer.val_every
        return bool(every and weight_version % every == 0) or weight_version == self.cfg.trainer.total_steps

    async def maybe_start(self, weight_version: int) -> bool:
        """Start a round for ``weight_version`` (the version every roller holds now) when due; True if so."""
        if not self.due(weight_version):
            return False
        self._versions.add(weight_version)
        index = len(self._versions) - 1
        uids = await self.rt.feeder.feed_validation.remote(index)
        self._rounds[index] = _Round(index, weight_version, set(uids))
        if self._collector is None or self._collector.done():
            if self._collector is not None:
                self._collector.result()  # re-raise a collector error
            self._collector = asyncio.ensure_future(self._collect())
        return True

    async def wait(self) -> None:
        """Wait until every started round is recorded; re-raises the collector's error."""
        while self._rounds:
            collector = self._collector
            assert collector is not None, "rounds in flight without a collector"
            await asyncio.wait({collector}, timeout=POLL_S)
            if collector.done():
                collector.result()

    async def close(self) -> None:
        """Cancel the collector (a stopped or failed run). Idempotent."""
        if self._collector is not None and not self._collector.done():
            self._collector.cancel()
            await asyncio.gather(self._collector, return_exceptions=True)

    def on_failed(self, uid: str) -> None:
        """A validation group failed (``rollers.on_failed_group=skip``): its round completes without it."""
        for rnd in self._rounds.values():
            if uid in rnd.uids:
                rnd.uids.discard(uid)
                rnd.num_failed_groups += 1

    async def _collect(self) -> None:
        while self._rounds:
            meta = await self.rt.tq.aget_meta(VAL_FIELDS, self.group_size, VAL_TASK, VAL_PARTITION,
                                              sampler="group_complete", options={"group_size": self.group_size},
                                              timeout_s=POLL_S)
            if len(meta) == 0:
                await self.check_rollers()
            else:
                uid = meta.tags[0][schema.UID]
                rnd = self._rounds.get(int(uid.split(".")[0][1:]))
                if rnd is None or uid not in rnd.uids:
                    raise RuntimeError(f"validation group {uid!r} belongs to no round in flight")
                rnd.uids.discard(uid)
                rnd.metas.append(meta)
            for rnd in [r for r in self._rounds.values() if not r.uids]:
                await self._finish(rnd)
                del self._rounds[rnd.index]

    async def _finish(self, rnd: _Round) -> None:
        from transferqueue.records import BatchMeta

        if not rnd.metas:
            logger.warning("validation round %d (weight_version %d): every group failed", rnd.index,
                           rnd.weight_version)
            return
        meta = BatchMeta.concat(rnd.metas)
        record = validation_record(list(meta.tags), rnd.weight_version, self.cfg.val.n)
        record["val/num_failed_groups"] = rnd.num_failed_groups
        record["val/duration_s"] = time.monotonic() - rnd.started
        if self.dump is not None:
            await self.dump(meta, "validation", rnd.weight_version, rnd.weight_version)
        await self.rt.tq.aclear(VAL_PARTITION, meta.sample_ids)
        self.records.append(record)
        self.on_record(record)
