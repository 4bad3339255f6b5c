"""The three schedules, each a short loop of named stages over the pools of ``controller.runtime``.

::

    sync          admit(B) → generate(B) → update → sync_weights                       (staleness 0)

    one-step-off  admit(B₀) → generate(B₀)
                  loop k:  admit(B_{k+1}) ┐ rollers generate B_{k+1} with v_k
                           update(B_k)    ┘ meanwhile the trainer trains on B_k
                           sync_weights (v_{k+1}) once both are done               (staleness exactly 1)

    fully-async   admitter task: admit while started − dropped ≤ (max_staleness + v + 1)·B − 1
                  loop:    generate(B · require_batches) as soon as complete groups are ready
                           (stale_policy on groups staler than max_staleness) → update
                           → sync_weights every trigger_sync_steps, in-flight requests paused and
                             resumed (partial rollout)                                (≤ max_staleness)

DAPO dynamic sampling (``algorithm.dynamic_sampling``, Yu et al. 2025 sec. 3.2) is one more stage inside
``generate``, so all three schedules share it: ``refill`` drops a group whose reward tags all agree (no
GRPO signal) and admits one fresh prompt in its place, up to ``algorithm.max_refill_rounds`` times per
slot; a slot whose rounds (or the data) run out trains its last group as it is (a *padded* group). The
step row reports ``dynamic_sampling/refill_rounds`` (deepest replacement among its groups),
``num_dropped_groups`` (zero-variance groups its groups replaced) and ``num_padded_groups``.

Rollers run their own loop (take a prompt group from the TransferQueue, generate ``rollout.n`` samples,
score, put back); a schedule only decides when prompt groups are admitted, when the trainer takes a batch,
and when weights move. ``v`` in the admission rule is the version the rollers hold.
The controller handles metadata only: uids, sample ids, tags (weight versions, lengths, rewards),
counts and timings.

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
from controller.admission import Admission, staleness
from controller.config import HFlowConfig
from controller.generations import GenerationDump
from controller.job_checkpoint import JobCheckpointer
from controller.metrics import JobMetrics
from controller.pool_keeper import PoolKeeper
from controller.report import RunReport, step_record, write_timeline
from controller.runtime import PARTITION, PROMPT_PARTITION, Runtime
from controller.validation import VAL_PARTITION, VAL_PROMPT_PARTITION, Validator
from trainers.dapo import filter_zero_variance_groups
from transferqueue.records import BatchMeta

logger = logging.getLogger(__name__)

TRAIN_FIELDS = list(schema.CONTROLLER.read_fields())  # a group is ready for training when these are (the trainer's)
REWARD_TAG = schema.REWARD
TRAIN_TASK = "train"  # the trainer's consumer task in the TransferQueue (the rollers' is "rollout")
POLL_S = 0.5
# fully-async replaces failed groups (rollers.on_failed_group=skip); the run fails once this many in a row (or
# two steps' worth, if more) failed with no group succeeding between: a reward or environment that always fails
MIN_FAILED_IN_A_ROW = 16


class RolloutFailure(RuntimeError):
    """A roller failed (its loop died, or a group failed with ``rollers.on_failed_group=fail``)."""


class Stages:
    """The named stages every schedule is written in, and the run's bookkeeping (metadata only)."""

    def __init__(self, cfg: HFlowConfig, rt: Runtime, metrics: JobMetrics, report: RunReport):
        self.cfg, self.rt, self.metrics, self.report = cfg, rt, metrics, report
        self.n = cfg.rollout.n
        self.groups_per_step = cfg.data.train_batch_size * (
            cfg.algorithm.require_batches if cfg.mode == "fully-async" else 1)
        self.total_groups = cfg.trainer.total_steps * self.groups_per_step
        self.admission = Admission(cfg.data.train_batch_size, cfg.algorithm.max_staleness)
        self.weight_version = 0          # trainer weight_version (completed updates)
        self.synced_weight_version = 0   # the version every roller holds
        self.step = 0
        self.num_syncs = 0
        self.num_failed_groups = 0
        # Skipped training groups not yet counted by ``generate`` (the validator's collector also calls
        # check_rollers, so a failure it drains must still reach the generate that waits for the group).
        self.num_unclaimed_skips = 0
        # fully-async: a failed group's slot goes to a fresh prompt, so its steps stay full (the batch of a sync
        # or one-step-off step is admitted before it is generated: that step trains fewer groups instead)
        self.replaces_failed = cfg.mode == "fully-async"
        self.failed_in_a_row = 0  # fully-async: groups failed since the last one that succeeded
        self.last_failure = ""  # the last skipped group's failure: uid, stage, first error
        self.num_dropped_groups = 0
        self.num_zero_variance_groups = 0  # dropped by dynamic sampling (each replaced by a fresh prompt)
        self.refill_depth: dict[str, int] = {}  # uid -> refill round that admitted it (absent = 0)
        self.exhausted = False    # the feeder has no more prompts
        self.finished = False     # the schedule is done: admit nothing more
        self.outstanding = 0      # groups admitted and not yet trained, dropped or failed
        self.admitted_at: dict[str, float] = {}
        self.rewards_by_uid: dict[str, list[float]] = {}
        self.changed = asyncio.Event()  # version synced or groups dropped: admission may allow more
        self.queue_depth: dict[str, int] = {}  # samples ready per consumer task, as of the last gauge refresh
        self.trainer_lock = asyncio.Lock()  # held by update and weight pushes: the policy is at weight_version
        self.keeper = PoolKeeper(self)  # the roller pool's health, replacements and resizes
        # Held by every stage that puts prompts or removes untrained groups, and by a job checkpoint's
        # snapshot (controller/job_checkpoint.py): the feeder, the TransferQueue and the counters agree.
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

    # ------------------------------------------------------------------------------------------ stages

    async def admit(self, max_groups: int, bounded: bool = True) -> int:
        """Start up to ``max_groups`` prompt groups (fewer at the end of the data); returns how many.

        ``bounded``: also stay within the staleness admission bound (fully-async); the sync and
        one-step-off loops bound staleness by their structure instead.
        """
        async with self.feeder_lock:
            k = min(max_groups, self.total_groups - (self.admission.started - self.admission.dropped))
            if bounded:
                k = min(k, self.admission.num_admissible(self.synced_weight_version))
            if k <= 0 or self.exhausted:
                return 0
            # Count the groups as started before awaiting the feeder, so a concurrent admit sees them.
            if bounded:
                self.admission.start(k, self.synced_weight_version)
            else:
                self.admission.started += k
            fed = await self.rt.feeder.feed.remote(k)
            if len(fed) < k:
                self.exhausted = True
                self.admission.started -= k - len(fed)
            self._track(fed)
            return len(fed)

    async def generate(self, num_groups: int, train_weight_version: int, enforce_staleness: bool = False):
        """Wait until ``num_groups`` whole prompt groups are generated and scored; their BatchMeta.

        Groups that failed (``rollers.on_failed_group=skip``) are not returned: in fully-async a fresh prompt
        takes each one's place (``check_rollers``) and the step waits for it; in sync and one-step-off they
        count toward ``num_groups`` (the step trains fewer; ``num_groups`` was taken from ``outstanding``, which
        failures already left, so every failure seen counts here). With ``enforce_staleness``, a group whose
        staleness at ``train_weight_version`` exceeds ``algorithm.max_staleness`` follows
        ``algorithm.stale_policy``. With ``algorithm.dynamic_sampling``,
        a zero-variance group is replaced (``refill``) and waited for. Returns fewer groups only when the
        prompt data has run out. Raises RolloutFailure (also when there is no group at all).
        """
        metas, skipped = [], 0
        while len(metas) + skipped < num_groups:
            if self.exhausted and len(metas) >= self.outstanding:
                break  # no prompt left to come: every group still outstanding is here
            meta = await self.rt.tq.aget_meta(TRAIN_FIELDS, self.n, TRAIN_TASK, PARTITION, sampler="group_complete",
                                              options={"group_size": self.n}, timeout_s=POLL_S)
            if len(meta) == 0:
                await self.check_rollers()
                if self.replaces_failed:
                    self.failed_in_a_row, self.num_unclaimed_skips = self.failed_in_a_row + self.num_unclaimed_skips, 0
                    if self.failed_in_a_row >= max(2 * self.groups_per_step, MIN_FAILED_IN_A_ROW):
                        raise RolloutFailure(f"{self.failed_in_a_row} groups in a row failed, none succeeded "
                                             f"(rollers.on_failed_group=skip replaces failed groups in fully-async; "
                                             f"a run fails when their replacements keep failing); the last: "
                                             f"{self.last_failure}")
                    continue
                skipped, self.num_unclaimed_skips = skipped + self.num_unclaimed_skips, 0
                continue
            self.num_samples_received += len(meta)
            self.failed_in_a_row = 0
            self.metrics.count_produced(self.num_samples_received)
            group_staleness = max(staleness(train_weight_version, t[schema.MIN_WEIGHT_VERSION])
                                  for t in meta.tags)
            if enforce_staleness and group_staleness > self.cfg.algorithm.max_staleness:
                if self.cfg.algorithm.stale_policy == "drop":
                    await self._drop(meta, group_staleness)
                    continue
                logger.warning("training group %s at staleness %d > max_staleness (stale_policy=keep)",
                               meta.tags[0][schema.UID], group_staleness)
            if self.cfg.algorithm.dynamic_sampling and await self.refill(meta):
                continue
            metas.append(meta)
        if not metas:
            if skipped:
                raise RolloutFailure(f"all {num_groups} groups of step {self.step + 1} failed")
            refills = (f"; {self.num_zero_variance_groups} prompts went to replace zero-variance groups "
                       "(algorithm.dynamic_sampling)" if self.cfg.algorithm.dynamic_sampling else "")
            if self.replaces_failed and self.num_failed_groups:
                refills += (f"; {self.num_failed_groups} prompts went to replace failed groups "
                            "(rollers.on_failed_group=skip)")
            raise RolloutFailure(f"the prompt data ran out before step {self.step + 1} "
                                 f"(data.epochs={self.cfg.data.epochs}){refills}: raise data.epochs or data.size")
        return BatchMeta.concat(metas)

    async def refill(self, meta) -> bool:
        """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11) on one whole group: when its reward
        tags all agree, clear it and admit one fresh prompt group in its place; True if it was replaced.

        The replacement takes the dropped group's place within the admission bound (``started`` and
        ``dropped`` both grow by one) and draws the next prompt of the data stream, so no prompt is used
        twice in an epoch. A group ``algorithm.max_refill_rounds`` replacements deep, or met when the
        data has run out, is kept and trained as it is (False): the step reports it as padded.
        """
        uid = meta.tags[0][schema.UID]
        rewards = torch.tensor([float(t[REWARD_TAG]) for t in meta.tags], dtype=torch.float64)
        if filter_zero_variance_groups([uid] * len(meta), rewards).kept_uids:
            return False
        async with self.feeder_lock:
            return await self._replace(meta, uid)

    async def _replace(self, meta, uid: str) -> bool:
        depth = self.refill_depth.get(uid, 0)
        fed = [] if depth >= self.cfg.algorithm.max_refill_rounds else await self.rt.feeder.feed.remote(1)
        if not fed:
            if depth < self.cfg.algorithm.max_refill_rounds:
                self.exhausted = True
            logger.warning("group %s has zero reward variance after %d refill rounds (%s); training it as it is",
                           uid, depth, "the prompt data ran out" if self.exhausted else
                           f"algorithm.max_refill_rounds={self.cfg.algorithm.max_refill_rounds}")
            return False
        await self.rt.tq.aclear(PARTITION, meta.sample_ids)
        self.admission.drop(1)
        self.admission.started += 1  # the replacement takes the dropped group's place within the bound
        self.num_zero_variance_groups += 1
        self.metrics.dropped.inc(len(meta))
        self._forget(uid)
        self.refill_depth[fed[0]["uid"]] = depth + 1
        self._track(fed)
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
        async with self.trainer_lock:  # a roller joining waits: it gets the weights of the version after
            train_metrics = await asyncio.to_thread(self.rt.trainer.train_step, meta)
            self.timeline["update"].append((wall_start, time.time()))
            self.weight_version += 1
            self.step += 1
        self.outstanding -= len(set(t[schema.UID] for t in meta.tags))
        await self.dump(meta, "train", self.step, self.weight_version - 1)
        await self.rt.tq.aclear(PARTITION, meta.sample_ids)
        self._record(meta, train_metrics, time.monotonic() - start, wait_s)
        if self.checkpointer.due(self.step):
            await self.checkpointer.save(self, "every trainer.save_every steps")
        self.metrics.trainer_wait.idle()  # after the checkpoint: saving is no wait for data
        self._wait_at_step_end = self.metrics.trainer_wait.total_s()
        return train_metrics

    async def sync_weights(self, pause_mode: str | None = None, wait_validation: bool = True) -> None:
        """Push the trainer's weights (``weight_version``) to every roller of the pool that lacks them and
        wait for every ack; a roller that dies or misses the deadline is replaced (``PoolKeeper.recover``).
        Then start a validation round when the new version is due. ``wait_validation``: first wait for the
        rounds in flight, so their samples come from one version (fully-async does not)."""
        if wait_validation:
            await self.validator.wait()
        start, wall_start = time.monotonic(), time.time()
        self.metrics.trainer_wait.busy()
        mode = pause_mode or self.cfg.checkpointengine.pause_mode
        async with self.trainer_lock:
            sent, lost = await self.rt.pool.push_weights(self.weight_version, mode)
        if lost:
            await self.keeper.recover(lost)
        self.synced_weight_version = self.weight_version
        self.num_syncs += 1
        self.timeline["sync"].append((wall_start, time.time()))
        self.metrics.sync_seconds.observe(time.monotonic() - start)
        self.metrics.sync_bytes.inc(float(sent.get("num_bytes", 0)) * len(sent.get("acked", [])))
        self._last_step_end = time.monotonic()
        self.metrics.trainer_wait.idle()
        self.changed.set()
        await self.validator.maybe_start(self.synced_weight_version)

    async def check_rollers(self) -> int:
        """Raise what ended the pool keeper (no roller left); handle failed groups per
        ``rollers.on_failed_group`` (``fail``: raise; ``skip``: count, clear, return how many training groups
        were skipped and add them to ``num_unclaimed_skips`` for ``generate``; in fully-async also free their
        slots in the admission bound for fresh prompts). Failed validation groups go
        to the validator (``Validator.on_failed``). A roller that died or stopped answering is the keeper's
        (``controller.pool_keeper``): replaced, its groups re-issued."""
        from controller.pool import RollerLost

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
        if self.cfg.rollers.on_failed_group == "skip":  # validation groups: their round completes without them
            for f in [f for f in failures if f.partition == VAL_PARTITION]:
                logger.warning("validation group %s failed in %s (skipped): %s", f.uid, f.stage, "; ".join(f.errors))
                await self.rt.tq.aclear(VAL_PROMPT_PARTITION, [f.prompt_id])
                self.validator.on_failed(f.uid)
            failures = [f for f in failures if f.partition != VAL_PARTITION]
        self.num_failed_groups += len(failures)  # counted whatever follows: the summary of a failed run too
        if self.cfg.rollers.on_failed_group == "fail":
            for f in failures[1:]:  # the run's error names the first
                logger.warning("%s", f)
            raise RolloutFailure(str(first))
        await _finish_before_cancel(self._skip(failures))
        return len(failures)

    async def _skip(self, failures: list) -> None:
        """Clear skipped training groups and count them, holding ``feeder_lock`` (a job checkpoint's snapshot
        sees each either before, as in flight, or after: gone and, in fully-async, its admission slot freed
        for a fresh prompt, ``_keep_admitting``)."""
        async with self.feeder_lock:
            for f in failures:
                logger.warning("group %s failed in %s (skipped): %s", f.uid, f.stage, "; ".join(f.errors))
                await self.rt.tq.aclear(PROMPT_PARTITION, [f.prompt_id])
                self._forget(f.uid)
                self.last_failure = f"group {f.uid} failed in {f.stage}: {f.errors[0] if f.errors else '?'}"
            self.num_unclaimed_skips += len(failures)
            if self.replaces_failed:
                self.admission.drop(len(failures))
        if self.replaces_failed:
            self.changed.set()

    # -------------------------------------------------------------------------------------- bookkeeping

    def _track(self, fed: list[dict]) -> None:
        """Note the admission time of groups just put by the feeder (for sample age)."""
        now = time.monotonic()
        for g in fed:
            self.admitted_at[g["uid"]] = now
        self.outstanding += len(fed)

    async def _drop(self, meta, group_staleness: int) -> None:
        await self.reissue(meta.tags[0][schema.UID], meta.sample_ids,
                           f"staleness {group_staleness} > {self.cfg.algorithm.max_staleness}", dropped=len(meta))

    async def reissue(self, uid: str, sample_ids: list[int], why: str, dropped: int = 0,
                      partition: str = PARTITION) -> None:
        """Clear group ``uid`` (``sample_ids`` of ``partition``: its samples, or its prompt row in
        ``PROMPT_PARTITION``) and put its prompt again under a fresh uid (``.r<k>``), in its place within the
        admission bound: a group dropped as too stale (``dropped``: its samples, counted as dropped), or
        held by a roller that left. Holds ``feeder_lock`` (a job checkpoint's snapshot sees the group either
        before or after)."""
        async with self.feeder_lock:
            logger.info("re-issuing group %s (%s)", uid, why)
            if dropped:
                self.num_dropped_groups += 1
                self.metrics.dropped.inc(dropped)
            await self.rt.tq.aclear(partition, list(sample_ids))
            self.admission.drop(1)
            self.admission.started += 1  # the re-issue takes the dropped group's place within the bound
            depth = self._forget(uid)
            fed = await self.rt.feeder.reissue.remote([uid])
            if depth:  # the re-issued prompt keeps its slot's refill round (dynamic sampling)
                self.refill_depth[fed[0]["uid"]] = depth
            self._track(fed)

    def _forget(self, uid: str) -> int:
        """Stop tracking group ``uid`` (dropped, or failed and skipped); returns its refill round."""
        self.admitted_at.pop(uid, None)
        self.outstanding -= 1
        return self.refill_depth.pop(uid, 0)

    def _note_short_step(self, meta) -> None:
        """Log one line when the step about to train has fewer prompt groups than a full step, and why."""
        num_groups = len({t[schema.UID] for t in meta.tags})
        if num_groups >= self.groups_per_step:
            return
        why = ("the prompt data has no more: a final partial batch (data.drop_last=true drops it instead)"
               if self.exhausted else "the others failed and were skipped (rollers.on_failed_group=skip)")
        logger.warning("step %d trains %d of %d prompt groups: %s", self.step + 1, num_groups,
                       self.groups_per_step, why)

    def _record(self, meta, train_metrics: dict, step_s: float, wait_s: float) -> None:
        now = time.monotonic()
        record, by_uid, stalenesses, lengths = step_record(meta.tags, self.step, self.weight_version,
                                                           max(now - self._last_step_end, 1e-9), step_s, wait_s)
        self.rewards_by_uid.update(by_uid)
        for uid, group in by_uid.items():
            age = now - self.admitted_at.pop(uid, now)
            for _ in group:  # one observation per sample, as hflow_sample_age_seconds says
                self.metrics.sample_age.observe(age)
        for value in stalenesses:
            self.metrics.queue_lag.observe(value)  # hflow_queue_lag: the staleness of trained samples
        for length in lengths:
            self.metrics.response_length.observe(length)
        record |= {**self._dynamic_sampling_stats(by_uid), **self._pool_stats(by_uid),
                   **{k: v for k, v in train_metrics.items() if isinstance(v, int | float)}}
        self.metrics.consumed.inc(len(meta.tags))
        self.metrics.reward_mean.set(record["reward_mean"])
        self.metrics.accuracy.set(record["accuracy"])
        self.metrics.response_clip_ratio.set(record["response_clip_ratio"])
        self.metrics.step_seconds.observe(step_s)
        self.metrics.weight_version.set(self.weight_version)
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
        events, k.events = k.events, []
        joins, k.first_trained = k.first_trained, []
        return {"roller_pool_size": self.rt.pool.size(), "num_roller_restarts": k.num_restarts,
                "num_rollers_lost": k.num_lost, "num_reissued_groups": k.num_reissued_groups,
                "num_weight_sync_timeouts": k.num_weight_sync_timeouts, "scale_events": events,
                "roller_joins": joins}

    def _dynamic_sampling_stats(self, rewards_by_uid: dict[str, list[float]]) -> dict[str, int]:
        """Per-step DAPO counts (only with ``algorithm.dynamic_sampling``): a group admitted in refill
        round d replaced d zero-variance groups before it."""
        if not self.cfg.algorithm.dynamic_sampling:
            return {}
        depths = [self.refill_depth.pop(uid, 0) for uid in rewards_by_uid]
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


# -------------------------------------------------------------------------------------------- schedules


async def run_sync(st: Stages) -> None:
    B = st.cfg.data.train_batch_size
    for _ in range(st.step, st.cfg.trainer.total_steps):
        # After a resume or a trainer restart, the groups already outstanding are part of the batch.
        fed = min(B, st.outstanding) + await st.admit(B - st.outstanding, bounded=False)
        meta = await st.generate(fed, train_weight_version=st.weight_version)
        await st.update(meta)
        await st.sync_weights()


async def run_one_step_off(st: Stages) -> None:
    B, total = st.cfg.data.train_batch_size, st.cfg.trainer.total_steps
    if st.step >= total:
        return
    # After a resume or a trainer restart, the groups already outstanding are part of B₀ (and of B₁ beyond it).
    fed = min(B, st.outstanding) + await st.admit(B - st.outstanding, bounded=False)
    meta = await st.generate(fed, train_weight_version=st.weight_version)
    for step in range(st.step, total):
        pending = None
        if step < total - 1:  # batch k+1: generated with v_k while the trainer trains on batch k
            ahead = st.outstanding - len({t[schema.UID] for t in meta.tags})  # of batch k+1, admitted already
            fed = min(B, ahead) + await st.admit(B - ahead, bounded=False)
            pending = asyncio.ensure_future(st.generate(fed, train_weight_version=st.weight_version + 1))
        try:
            await st.update(meta)
            meta = await pending if pending is not None else None
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
        await st.sync_weights()


async def run_fully_async(st: Stages) -> None:
    per_step = st.groups_per_step
    admitter = asyncio.ensure_future(_keep_admitting(st))
    try:
        for step in range(st.step, st.cfg.trainer.total_steps):
            need = per_step if not st.exhausted else min(per_step, st.outstanding)
            meta = await st.generate(need, train_weight_version=st.weight_version, enforce_staleness=True)
            await st.update(meta)
            last = step == st.cfg.trainer.total_steps - 1
            if st.weight_version % st.cfg.algorithm.trigger_sync_steps == 0 or last:
                await st.sync_weights(wait_validation=False)  # validation overlaps training
            if admitter.done():
                admitter.result()  # re-raise an admission error
    finally:
        st.finished = True
        st.changed.set()
        await asyncio.wait({admitter}, timeout=10 * POLL_S)
        admitter.cancel()
        await asyncio.gather(admitter, return_exceptions=True)


async def _keep_admitting(st: Stages) -> None:
    """Admit prompt groups whenever the staleness bound allows (woken by syncs and drops)."""
    while not st.exhausted and not st.finished:
        st.changed.clear()
        await st.admit(st.total_groups)
        try:
            async with asyncio.timeout(POLL_S):
                await st.changed.wait()
        except TimeoutError:
            pass


SCHEDULES = {"sync": run_sync, "one-step-off": run_one_step_off, "fully-async": run_fully_async}
