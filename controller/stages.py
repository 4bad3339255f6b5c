"""The named stages every schedule (``controller.schedules``) is written in, over the pools of
``controller.runtime``; the group ledger (``controller.ledger``) keeps every group's state.

* ``admit(k)``: ask the ledger for up to k slots (within the staleness bound for a bounded schedule), have the
  prompt feeder put that many prompt groups, tell the ledger which.
* ``generate(k)``: wait until k whole groups are generated and scored (the rollers run their own loop: take
  a prompt group from the TransferQueue, generate ``rollout.n`` samples, score, put back); a group staler
  than the bound follows ``algorithm.stale_policy``; failed groups are skipped or fail the run.
* ``update(batch)``: the trainer's step (the ranks fetch the tensors); the ledger counts it trained.
* ``sync_weights``: push the trainer's version to every roller; the ledger records the rollers' version.

DAPO dynamic sampling (``algorithm.dynamic_sampling``, Yu et al. 2025 sec. 3.2) is one more stage inside
``generate``, so every schedule shares it: ``refill`` drops a group whose reward tags all agree (no GRPO
signal) and admits one fresh prompt in its place, up to ``algorithm.max_refill_rounds`` times per slot; a
slot whose rounds (or the data) run out trains its last group as it is (a *padded* group). The step row
reports ``dynamic_sampling/refill_rounds`` (deepest replacement among its groups),
``num_dropped_groups`` (zero-variance groups its groups replaced) and ``num_padded_groups``.

The controller handles metadata only: uids, sample ids, tags (weight versions, lengths, rewards), counts and
timings.

Validation (``controller.validation``) hangs off ``sync_weights``: after a sync makes version v current on
every roller, a round starts when v is due; the rollers take its groups before training groups. ``sync``
and ``one-step-off`` wait for the round before the next sync (single-version rows); ``fully-async`` keeps
training and syncing. Generation dumps (``controller.generations``) are written in ``update`` before the
trained samples are cleared.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from common import schema
from controller.config import HFlowConfig
from controller.generations import GenerationDump
from controller.job_checkpoint import JobCheckpointer
from controller.layout import PARTITION, PROMPT_PARTITION, TRAIN_TASK
from controller.ledger import (
    REISSUED_ROLLER_LEFT,
    REISSUED_STALE,
    ZERO_VARIANCE,
    GroupLedger,
    TrainedGroup,
    staleness,
)
from controller.metrics import JobMetrics
from controller.pool import RollerLost
from controller.pool_keeper import PoolKeeper
from controller.report import RunReport, step_record, write_timeline
from controller.runtime import Runtime
from controller.schedules import POLL_S, SCHEDULES
from controller.validation import VAL_PARTITION, VAL_PROMPT_PARTITION, Validator
from trainers.dapo import filter_zero_variance_groups
from transferqueue.records import BatchMeta

logger = logging.getLogger(__name__)

TRAIN_FIELDS = list(schema.CONTROLLER.read_fields())  # a group is ready for training when these are (the trainer's)
REWARD_TAG = schema.REWARD
# A schedule that replaces failed groups (rollers.on_failed_group=skip) fails the run once this many in a row (or
# two steps' worth, if more) failed with no group succeeding between: a reward or environment that always fails
MIN_FAILED_IN_A_ROW = 16


class RolloutFailure(RuntimeError):
    """A roller failed (its loop died, or a group failed with ``rollers.on_failed_group=fail``)."""


class Stages:
    """The named stages every schedule is written in (module docstring), and what the run keeps beside the
    ledger: metrics, the step report, locks, the pool keeper, the validator (metadata only)."""

    def __init__(self, cfg: HFlowConfig, rt: Runtime, metrics: JobMetrics, report: RunReport):
        self.cfg, self.rt, self.metrics, self.report = cfg, rt, metrics, report
        self.schedule = SCHEDULES.get(cfg.mode)
        self.n = cfg.rollout.n
        self.groups_per_step = self.schedule.groups_per_step(cfg)
        self.total_groups = cfg.trainer.total_steps * self.groups_per_step
        self.ledger = GroupLedger(cfg.data.train_batch_size, cfg.algorithm.max_staleness, self.total_groups,
                                  self.schedule.replaces_failed)
        # Skipped training groups not yet counted by ``generate`` (the validator's collector also calls
        # check_rollers, so a failure it drains must still reach the generate that waits for the group).
        self.num_unclaimed_skips = 0
        self.failed_in_a_row = 0  # replaces_failed: groups failed since the last one that succeeded
        self.last_failure = ""  # the last skipped group's failure: uid, stage, first error
        self.rewards_by_uid: dict[str, list[float]] = {}  # of every trained group: the summary's reward stats
        self.changed = asyncio.Event()  # version synced or groups dropped: admission may allow more
        self.queue_depth: dict[str, int] = {}  # samples ready per consumer task, as of the last gauge refresh
        self.trainer_lock = asyncio.Lock()  # held by update and weight pushes: the policy is at weight_version
        self.keeper = PoolKeeper(self)  # the roller pool's health, replacements and resizes
        # Held by every stage that puts prompts or removes untrained groups, and by a job checkpoint's
        # snapshot (controller/job_checkpoint.py): the feeder, the TransferQueue and the ledger agree.
        self.feeder_lock = asyncio.Lock()
        self.checkpointer = JobCheckpointer(cfg)
        self._last_step_end = time.monotonic()
        self.metrics.trainer_wait.idle()  # the trainer waits for the first batch
        self._wait_at_step_end = self.metrics.trainer_wait.total_s()
        self.num_samples_received = 0  # samples taken from the TransferQueue (each one was produced)
        self.num_groups_generated = 0
        # (start, end) wall-clock seconds (time.time()) of every trainer update and weight sync: timeline.json
        self.timeline: dict[str, list[tuple[float, float]]] = {"update": [], "sync": []}
        self.dump = GenerationDump(cfg.run_dir, cfg.metrics.dump_every, rt)
        self.validator = Validator(cfg, rt, self._record_validation, self.check_rollers, self.dump)

    async def run(self) -> None:
        """Run the schedule of ``mode`` from the ledger's step."""
        await self.schedule.run(self)

    @staticmethod
    def num_groups(meta) -> int:
        """Prompt groups in ``meta`` (distinct uids of its tags)."""
        return len({t[schema.UID] for t in meta.tags})

    # ------------------------------------------------------------------------------------------ stages

    async def admit(self, max_groups: int, bounded: bool = True) -> int:
        """Start up to ``max_groups`` prompt groups (fewer at the end of the data); returns how many.

        ``bounded``: also stay within the staleness admission bound (a bounded schedule); the others bound
        staleness by their structure instead.
        """
        async with self.feeder_lock:
            k = self.ledger.reserve(max_groups, bounded)  # counted before the await: a concurrent admit sees them
            if k == 0:
                return 0
            fed = await self.rt.feeder.feed.remote(k)
            self.ledger.admitted(k, [g["uid"] for g in fed])
            return len(fed)

    async def generate(self, num_groups: int, train_weight_version: int, enforce_staleness: bool = False):
        """Wait until ``num_groups`` whole prompt groups are generated and scored; their BatchMeta.

        Groups that failed (``rollers.on_failed_group=skip``) are not returned: where the schedule replaces
        failed groups a fresh prompt takes each one's place (``check_rollers``) and the step waits for it;
        elsewhere they count toward ``num_groups`` (the step trains fewer; ``num_groups`` was taken from the
        ledger's outstanding groups, which failures already left, so every failure seen counts here). With
        ``enforce_staleness``, a group whose staleness when trained from ``train_weight_version`` exceeds
        ``algorithm.max_staleness`` follows ``algorithm.stale_policy``. With ``algorithm.dynamic_sampling``,
        a zero-variance group is replaced (``refill``) and waited for. Returns fewer groups only when the
        prompt data has run out. Raises RolloutFailure (also when there is no group at all).
        """
        metas, skipped = [], 0
        while len(metas) + skipped < num_groups:
            if self.ledger.exhausted and len(metas) >= self.ledger.outstanding:
                break  # no prompt left to come: every group still outstanding is here
            meta = await self.rt.tq.aget_meta(TRAIN_FIELDS, self.n, TRAIN_TASK, PARTITION, sampler="group_complete",
                                              options={"group_size": self.n}, timeout_s=POLL_S)
            if len(meta) == 0:
                await self.check_rollers()
                if self.schedule.replaces_failed:
                    self.failed_in_a_row, self.num_unclaimed_skips = self.failed_in_a_row + self.num_unclaimed_skips, 0
                    if self.failed_in_a_row >= max(2 * self.groups_per_step, MIN_FAILED_IN_A_ROW):
                        raise RolloutFailure(f"{self.failed_in_a_row} groups in a row failed, none succeeded "
                                             f"(rollers.on_failed_group=skip replaces failed groups in {self.cfg.mode}; "
                                             f"a run fails when their replacements keep failing); the last: "
                                             f"{self.last_failure}")
                    continue
                skipped, self.num_unclaimed_skips = skipped + self.num_unclaimed_skips, 0
                continue
            self.num_samples_received += len(meta)
            self.failed_in_a_row = 0
            self.metrics.count_produced(self.num_samples_received)
            group_staleness = max(staleness(train_weight_version, t[schema.MIN_WEIGHT_VERSION]) for t in meta.tags)
            if enforce_staleness and group_staleness > self.cfg.algorithm.max_staleness:
                if self.cfg.algorithm.stale_policy == "drop":
                    await self.reissue(meta.tags[0][schema.UID], meta.sample_ids, REISSUED_STALE,
                                       f"staleness {group_staleness} > {self.cfg.algorithm.max_staleness}")
                    continue
                logger.warning("training group %s at staleness %d > max_staleness (stale_policy=keep)",
                               meta.tags[0][schema.UID], group_staleness)
            if self.cfg.algorithm.dynamic_sampling and await self.refill(meta):
                continue
            metas.append(meta)
        if not metas:
            if skipped:
                raise RolloutFailure(f"all {num_groups} groups of step {self.ledger.step + 1} failed")
            counts = self.ledger.counts()
            refills = (f"; {counts['num_zero_variance_groups']} prompts went to replace zero-variance groups "
                       "(algorithm.dynamic_sampling)" if self.cfg.algorithm.dynamic_sampling else "")
            if self.schedule.replaces_failed and counts["num_failed_groups"]:
                refills += (f"; {counts['num_failed_groups']} prompts went to replace failed groups "
                            "(rollers.on_failed_group=skip)")
            raise RolloutFailure(f"the prompt data ran out before step {self.ledger.step + 1} "
                                 f"(data.epochs={self.cfg.data.epochs}){refills}: raise data.epochs or data.size")
        return BatchMeta.concat(metas)

    async def refill(self, meta) -> bool:
        """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11) on one whole group: when its reward
        tags all agree, clear it and admit one fresh prompt group in its place; True if it was replaced.

        The replacement takes the dropped group's slot within the admission bound (``GroupLedger.replaced``)
        and draws the next prompt of the data stream, so no prompt is used twice in an epoch. A group
        ``algorithm.max_refill_rounds`` replacements deep, or met when the data has run out, is kept and
        trained as it is (False): the step reports it as padded.
        """
        uid = meta.tags[0][schema.UID]
        rewards = torch.tensor([float(t[REWARD_TAG]) for t in meta.tags], dtype=torch.float64)
        if filter_zero_variance_groups([uid] * len(meta), rewards).kept_uids:
            return False
        async with self.feeder_lock:
            return await self._replace(meta, uid)

    async def _replace(self, meta, uid: str) -> bool:
        depth, rounds = self.ledger.refill_round(uid), self.cfg.algorithm.max_refill_rounds
        fed = [] if depth >= rounds else await self.rt.feeder.feed.remote(1)
        if not fed:
            if depth < rounds:
                self.ledger.out_of_data()
            logger.warning("group %s has zero reward variance after %d refill rounds (%s); training it as it is",
                           uid, depth, "the prompt data ran out" if self.ledger.exhausted else
                           f"algorithm.max_refill_rounds={rounds}")
            return False
        await self.rt.tq.aclear(PARTITION, meta.sample_ids)
        self.ledger.replaced(uid, fed[0]["uid"], ZERO_VARIANCE)
        self.metrics.dropped.inc(len(meta))
        return True

    async def update(self, meta) -> dict:
        """Trainer step on ``meta`` (the ranks fetch the tensors): old log-probs, advantages, update; then a
        job checkpoint every ``trainer.save_every`` steps. A stop signal arriving meanwhile takes effect
        once the step is trained and recorded, so the trainer and the controller agree on the step."""
        return await _finish_before_cancel(self._update(meta))

    async def _update(self, meta) -> dict:
        start, wall_start = time.monotonic(), time.time()
        self.metrics.trainer_wait.busy()
        wait_s = self.metrics.trainer_wait.total_s() - self._wait_at_step_end  # idle since the last step
        self._note_short_step(meta)
        trained_from = self.ledger.weight_version
        async with self.trainer_lock:  # a roller joining waits: it gets the weights of the version after
            train_metrics = await asyncio.to_thread(self.rt.trainer.train_step, meta)
            self.timeline["update"].append((wall_start, time.time()))
            trained = self.ledger.trained([t[schema.UID] for t in meta.tags])
        await self.dump(meta, "train", self.ledger.step, trained_from)
        await self.rt.tq.aclear(PARTITION, meta.sample_ids)
        self._record(meta, trained_from, trained, train_metrics, time.monotonic() - start, wait_s)
        if self.checkpointer.due(self.ledger.step):
            await self.checkpointer.save(self, "every trainer.save_every steps")
        self.metrics.trainer_wait.idle()  # after the checkpoint: saving is no wait for data
        self._wait_at_step_end = self.metrics.trainer_wait.total_s()
        return train_metrics

    async def sync_weights(self, pause_mode: str | None = None, wait_validation: bool = True) -> None:
        """Push the trainer's weights (the ledger's ``weight_version``) to every roller of the pool that lacks
        them and wait for every ack; a roller that dies or misses the deadline is replaced
        (``PoolKeeper.recover``). Then start a validation round when the new version is due.
        ``wait_validation``: first wait for the rounds in flight, so their samples come from one version
        (fully-async does not)."""
        if wait_validation:
            await self.validator.wait()
        start, wall_start = time.monotonic(), time.time()
        self.metrics.trainer_wait.busy()
        mode = pause_mode or self.cfg.checkpointengine.pause_mode
        weight_version = self.ledger.weight_version
        async with self.trainer_lock:
            sent, lost = await self.rt.pool.push_weights(weight_version, mode)
        if lost:
            await self.keeper.recover(lost)
        self.ledger.synced(weight_version)
        self.timeline["sync"].append((wall_start, time.time()))
        self.metrics.sync_seconds.observe(time.monotonic() - start)
        self.metrics.sync_bytes.inc(float(sent.get("num_bytes", 0)) * len(sent.get("acked", [])))
        self._last_step_end = time.monotonic()
        self.metrics.trainer_wait.idle()
        self.changed.set()
        await self.validator.maybe_start(weight_version)

    async def check_rollers(self) -> int:
        """Raise what ended the pool keeper (no roller left); handle failed groups per
        ``rollers.on_failed_group`` (``fail``: raise; ``skip``: clear them, tell the ledger, return how many
        training groups were skipped and add them to ``num_unclaimed_skips`` for ``generate``). Failed
        validation groups go to the validator (``Validator.on_failed``). A roller that died or stopped
        answering is the keeper's (``controller.pool_keeper``): replaced, its groups re-issued."""
        try:
            self.keeper.raise_error()
        except Exception as exc:
            raise RolloutFailure(str(exc)) from exc
        failures = []
        for member in self.rt.pool.live():
            try:
                failures += await self.rt.pool.call(member, "drain_failures")
            except RollerLost as lost:
                await self.keeper.recover([lost])
        if not failures:
            return 0
        first = failures[0]
        if self.cfg.rollers.on_failed_group == "fail":
            self.ledger.failed([f.uid for f in failures], skipped=False)  # the summary of the failed run counts them
            for f in failures[1:]:  # the run's error names the first
                logger.warning("%s", f)
            raise RolloutFailure(str(first))
        for f in [f for f in failures if f.partition == VAL_PARTITION]:  # their round completes without them
            logger.warning("validation group %s failed in %s (skipped): %s", f.uid, f.stage, "; ".join(f.errors))
            await self.rt.tq.aclear(VAL_PROMPT_PARTITION, [f.prompt_id])
            self.validator.on_failed(f.uid)
        failures = [f for f in failures if f.partition != VAL_PARTITION]
        if failures:
            await _finish_before_cancel(self._skip(failures))
        return len(failures)

    async def _skip(self, failures: list) -> None:
        """Clear skipped training groups and tell the ledger, holding ``feeder_lock`` (a job checkpoint's
        snapshot sees each either before, as in flight, or after: gone and, where the schedule replaces
        failed groups, its admission slot freed for a fresh prompt)."""
        async with self.feeder_lock:
            for f in failures:
                logger.warning("group %s failed in %s (skipped): %s", f.uid, f.stage, "; ".join(f.errors))
                await self.rt.tq.aclear(PROMPT_PARTITION, [f.prompt_id])
                self.last_failure = f"group {f.uid} failed in {f.stage}: {f.errors[0] if f.errors else '?'}"
            self.ledger.failed([f.uid for f in failures], skipped=True)
            self.num_unclaimed_skips += len(failures)
        if self.schedule.replaces_failed:
            self.changed.set()

    async def reissue(self, uid: str, sample_ids: list[int], why: str, detail: str,
                      partition: str = PARTITION) -> None:
        """Clear group ``uid`` (``sample_ids`` of ``partition``: its samples, or its prompt row in
        ``PROMPT_PARTITION``) and put its prompt again under a fresh uid (``.r<k>``) in its slot
        (``GroupLedger.replaced``; ``why``: one of ``controller.ledger``'s ``REISSUED_*``, ``detail`` for
        the log). Samples cleared for any reason but a roller leaving count as dropped. Holds
        ``feeder_lock`` (a job checkpoint's snapshot sees the group either before or after)."""
        async with self.feeder_lock:
            logger.info("re-issuing group %s (%s)", uid, detail)
            if why != REISSUED_ROLLER_LEFT:
                self.metrics.dropped.inc(len(sample_ids))
            await self.rt.tq.aclear(partition, list(sample_ids))
            fed = await self.rt.feeder.reissue.remote([uid])
            self.ledger.replaced(uid, fed[0]["uid"], why)

    # -------------------------------------------------------------------------------------- bookkeeping

    def _note_short_step(self, meta) -> None:
        """Log one line when the step about to train has fewer prompt groups than a full step, and why."""
        num_groups = self.num_groups(meta)
        if num_groups >= self.groups_per_step:
            return
        why = ("the prompt data has no more: a final partial batch (data.drop_last=true drops it instead)"
               if self.ledger.exhausted else "the others failed and were skipped (rollers.on_failed_group=skip)")
        logger.warning("step %d trains %d of %d prompt groups: %s", self.ledger.step + 1, num_groups,
                       self.groups_per_step, why)

    def _record(self, meta, trained_from: int, trained: list[TrainedGroup], train_metrics: dict, step_s: float,
                wait_s: float) -> None:
        now = time.monotonic()
        record, by_uid, stalenesses, lengths = step_record(meta.tags, trained_from,
                                                           max(now - self._last_step_end, 1e-9), step_s, wait_s)
        self.rewards_by_uid.update(by_uid)
        for group in trained:
            for _ in by_uid[group.uid]:  # one observation per sample, as hflow_sample_age_seconds says
                self.metrics.sample_age.observe(group.age_s)
        for value in stalenesses:
            self.metrics.queue_lag.observe(value)  # hflow_queue_lag: the staleness of trained samples
        for length in lengths:
            self.metrics.response_length.observe(length)
        record |= {**self._dynamic_sampling_stats(trained, by_uid), **self._pool_stats(by_uid),
                   **{k: v for k, v in train_metrics.items() if isinstance(v, int | float)}}
        self.metrics.consumed.inc(len(meta.tags))
        self.metrics.reward_mean.set(record["reward_mean"])
        self.metrics.accuracy.set(record["accuracy"])
        self.metrics.response_clip_ratio.set(record["response_clip_ratio"])
        self.metrics.step_seconds.observe(step_s)
        self.metrics.weight_version.set(self.ledger.weight_version)
        self.report.log_step(record)
        self._last_step_end = now

    def _record_validation(self, record: dict) -> None:
        self.metrics.observe_validation(record)
        self.report.log_validation(record)

    def _pool_stats(self, trained_uids) -> dict:
        """The roller pool's counters for the step record, and the scale events and completed roller joins
        (``PoolKeeper.joins``) since the last one; tells the keeper which groups this step trained."""
        k = self.keeper
        k.note_trained(trained_uids)
        events, joins = k.take_events()
        return {"roller_pool_size": self.rt.pool.size(), "num_roller_restarts": k.num_restarts,
                "num_rollers_lost": k.num_lost, "num_reissued_groups": self.ledger.counts()["num_reissued_groups"],
                "num_weight_sync_timeouts": k.num_weight_sync_timeouts, "scale_events": events,
                "roller_joins": joins}

    def _dynamic_sampling_stats(self, trained: list[TrainedGroup], rewards_by_uid: dict[str, list[float]]
                                ) -> dict[str, int]:
        """Per-step DAPO counts (only with ``algorithm.dynamic_sampling``): a group admitted in refill
        round d replaced d zero-variance groups before it."""
        if not self.cfg.algorithm.dynamic_sampling:
            return {}
        depths = [g.refill_round for g in trained]
        return {
            "dynamic_sampling/refill_rounds": max(depths, default=0),
            "dynamic_sampling/num_dropped_groups": sum(depths),
            "dynamic_sampling/num_padded_groups": sum(max(r) == min(r) for r in rewards_by_uid.values()),
        }

    async def refresh_gauges(self) -> None:
        """Queue depth per task from the index, and roller throughput/busy ratio (metadata only)."""
        per_row = {PROMPT_PARTITION: self.n, VAL_PROMPT_PARTITION: self.validator.group_size}
        self.queue_depth = self.metrics.observe_queue_depth(await self.rt.tq.astatus(), per_row)
        self.num_groups_generated = await self.metrics.observe_pool(self.rt.pool)

    async def write_timeline(self) -> dict:
        """``controller.report.write_timeline`` of this run's updates, syncs and roller busy intervals."""
        return await write_timeline(Path(self.cfg.run_dir), self.timeline, self.rt.pool)


async def _finish_before_cancel(coro):
    """Await ``coro`` to its end even when the awaiting task is cancelled meanwhile; then re-raise the
    cancellation (``asyncio.shield`` alone would return at the cancellation, leaving ``coro`` running)."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
