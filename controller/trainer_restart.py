"""Restart the trainer group alone after a lost rank (``trainer.max_restarts``): the rollers, the prompt feeder
and the TransferQueue keep running, and keep what they hold.

::

    a stage raises TrainerRankLost ──> the schedule unwinds (fully-async: its admitter stops; the rollers go on
    │                                   generating the groups already admitted, the TransferQueue keeps them)
    ├─ 1. a new TrainerGroup (new processes), loaded from the latest job checkpoint: step S, weight_version S
    ├─ 2. the weight plane rewired: a sender on the new rank 0; every roller re-attaches (an update still
    │     waiting for the lost sender is cancelled; the engine keeps its weights and version)
    ├─ 3. the run taken back to step S: the step rows after S are superseded and their prompts queued again in
    │     the feeder (their samples were trained and cleared); the samples a lost step had taken are handed to
    │     the trainer again (the train task's consumption is reset)
    ├─ 4. rollers holding a version newer than S replaced; every sample with a token of such a version dropped
    │     and its prompt re-issued (see "Versions")
    ├─ 5. every roller brought to S (those below it get the restored weights)
    └─ 6. the schedule runs again from step S

Versions. The restored trainer has the checkpoint's ``weight_version`` S and goes on with S+1, S+2, ...:
``weight_version`` stays the count of updates the policy has had, so the admission bound
(``started − dropped ≤ (max_staleness + v + 1)·B − 1``) and every staleness (the trainer's version minus a
sample's ``min_weight_version``) keep counting real updates. Continuing the version sequence instead (the
restored weights as V+1, V the lost trainer's last version) would count updates the policy never had:
admission would let (V+1−S)·B more groups start than the bound allows, and staleness would be misstated.
The price of restoring S is that a version number must name one set of weights: nothing made with the lost
updates (versions S+1..V) may live on beside the new S+1..V. So:

* samples whose every token came from a version ≤ S were generated with weights the restored trainer had
  (its own history): kept, with their versions; their staleness is counted against the restored trainer
  as usual, and ``fully-async`` still applies ``algorithm.stale_policy`` to a group beyond the bound;
* a roller holding a version > S is replaced (engines commit only increasing versions, and its weights are in
  no history the restored trainer will have; the replacement joins at S); the groups it held are re-issued,
  and every finished group with a token of a version > S is dropped and re-issued (counted as dropped).

With ``trainer.save_every=1`` the second case never happens: a step's checkpoint is written before its
weights are pushed, so no roller holds a version newer than the latest checkpoint.

Exactly once: at the restart every prompt issued so far is either trained at a step ≤ S (its row is kept),
outstanding in the TransferQueue (kept, or re-issued under a fresh ``.r<k>`` uid), or trained after S (its row
superseded, its prompt requeued: admitted again before any new prompt of the stream). The admission counters
stay the run's: a requeued prompt's slot is released (counted dropped) and started again when admitted.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

from common import schema
from controller.layout import PARTITION, TRAIN_TASK
from controller.ledger import REISSUED_NEWER_WEIGHTS
from rollers.roller import TAKE_POLL_S

logger = logging.getLogger(__name__)

RESTARTS_KEY = "num_trainer_restarts"  # in the run's counters (summary.json): restarts over the whole job
GONE_TIMEOUT_S = 60.0  # a replaced roller's process is gone within this after it was killed


def restart_point(cfg, lost: BaseException, counts: dict, what: str, then: str = "") -> Path:
    """The job checkpoint to restart ``what`` (e.g. "the trainer group") from after ``lost`` (a
    ``TrainerRankLost``); counts the restart in ``counts[RESTARTS_KEY]`` (the job's, shared by both kinds of
    restart) and prints one line, ending in ``then``. Re-raises ``lost`` when ``trainer.max_restarts`` are
    used up or there is no job checkpoint yet (a line says so)."""
    from controller.job_checkpoint import list_checkpoints

    found = list_checkpoints(cfg.run_dir)
    if counts.get(RESTARTS_KEY, 0) >= cfg.trainer.max_restarts or not found:
        if cfg.trainer.max_restarts and not found:
            print("hflow-async: no job checkpoint to restart from yet (trainer.save_every="
                  f"{cfg.trainer.save_every})", file=sys.stderr, flush=True)
        raise lost
    path = found[max(found)]
    counts[RESTARTS_KEY] = counts.get(RESTARTS_KEY, 0) + 1
    print(f"hflow-async: {lost}; restarting {what} from {path} (restart {counts[RESTARTS_KEY]} of "
          f"trainer.max_restarts={cfg.trainer.max_restarts}){then}", file=sys.stderr, flush=True)
    return path


async def run_with_restarts(st, counts: dict) -> None:
    """Run ``st``'s schedule (``st``: ``controller.stages.Stages``; ``Stages.run``). When a trainer rank is lost, restart the
    trainer group alone from the latest job checkpoint (``restart_trainer``) and run the schedule again from
    there, at most ``trainer.max_restarts`` times over the job (``counts[RESTARTS_KEY]``, shared with
    ``controller.job``'s restart of every pool). Re-raises the ``TrainerRankLost`` when no restart is left."""
    from trainers.group import TrainerRankLost

    while True:
        try:
            await st.run()
            return
        except TrainerRankLost as lost:
            path = restart_point(st.cfg, lost, counts, "the trainer group", "; the rollers keep running")
            await restart_trainer(st, path)


async def restart_trainer(st, path: Path) -> None:
    """Steps 1-5 of the module docstring: a new trainer group at the job checkpoint ``path``, the weight plane
    rewired, ``st`` taken back to the checkpoint's step with the TransferQueue reconciled, every roller at the
    restored version. Raises ValueError when the trainer's restored ``weight_version`` disagrees with the
    checkpoint's ``job.json``; a lost rank of the new group raises TrainerRankLost again."""
    from controller.job_checkpoint import JobState

    started = time.monotonic()
    state = JobState.read(path)
    restored = state.step
    # First: a stop signal during the restart writes no checkpoint (this step's is there already).
    st.ledger.rewind(state.weight_version)
    st.checkpointer.last_saved_step = restored
    async with st.trainer_lock:  # a roller joining meanwhile waits, then gets the restored weights
        await asyncio.to_thread(st.rt.restart_trainer)
        await asyncio.to_thread(st.rt.trainer.load_checkpoint, str(path))
        loaded_weight_version = await asyncio.to_thread(st.rt.trainer.get_weight_version)
        if loaded_weight_version != state.weight_version:
            raise ValueError(f"{path}: the trainer checkpoint has weight_version {loaded_weight_version}, "
                             f"its job.json says {state.weight_version}")
        unreachable = await st.rt.pool.rewire(st.rt.trainer)
    if unreachable:
        await st.keeper.recover(unreachable)
    num_requeued = await _take_back_steps(st, restored)
    num_live = len(st.rt.pool.live())
    num_replaced = await _replace_newer_rollers(st, state.weight_version)
    if num_replaced:
        await st.keeper.reissue_orphans()  # the groups the replaced rollers held
    num_dropped = await _drop_newer_samples(st, state.weight_version)
    await _hand_back_taken_samples(st)
    st.ledger.reopen()  # admission closed at the end of the schedule that was cut short
    await st.sync_weights(wait_validation=False)
    print(f"hflow-async: trainer group restarted from step {restored} (weight_version {state.weight_version}) in "
          f"{time.monotonic() - started:.1f}s; rollers: {num_live - num_replaced} kept, {num_replaced} replaced; "
          f"{num_requeued} trained groups requeued, {num_dropped} dropped for newer weights", flush=True)


async def _take_back_steps(st, step: int) -> int:
    """Forget the step rows after ``step`` and queue their prompts again in the feeder (their slots released
    in the admission counters); returns how many groups were requeued."""
    forgotten = st.report.rewind(step)
    uids = [uid for row in forgotten for uid in row["uids"]]
    if not uids:
        return 0
    for uid in uids:
        st.rewards_by_uid.pop(uid, None)
    async with st.feeder_lock:
        await st.rt.feeder.requeue.remote(uids)
        st.ledger.requeued(uids)  # their slots released: each is started again when admitted
    logger.info("trainer restart: steps %d..%d superseded; their %d groups requeued", step + 1,
                max(r["step"] for r in forgotten), len(uids))
    return len(uids)


async def _replace_newer_rollers(st, weight_version: int) -> int:
    """Replace every live roller that holds weights newer than ``weight_version`` (the replacement joins at
    ``weight_version``; not counted against ``rollers.max_restarts``); returns how many once every replaced process
    is gone (so nothing it generated can still reach the TransferQueue) and its last take's long-poll has
    ended at the index (a poll parked there by a roller that Ray already reports dead would take the next
    prompt row put with it, unseen by the orphan look that follows)."""
    newer = [m for m in st.rt.pool.live() if m.weight_version > weight_version]
    for member in newer:
        logger.warning("roller %s holds weight_version %d, newer than the restored %d: replaced", member.name,
                       member.weight_version, weight_version)
        st.rt.pool.retire(member.name)
        st.keeper.event("down", "replacement", member.name)
        st.keeper.spawn("replacement")
    await asyncio.gather(*(_wait_gone(st.rt.pool, m) for m in newer))
    if newer:
        await asyncio.sleep(TAKE_POLL_S + 1.0)
    return len(newer)


async def _wait_gone(pool, member, timeout_s: float = GONE_TIMEOUT_S) -> None:
    """Wait until the retired ``member``'s process no longer answers as alive (killed by ``RollerPool.retire``);
    RuntimeError after ``timeout_s``."""
    from controller.pool import RollerLost

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await pool.call(member, "ping", timeout_s=1.0)
        except RollerLost as lost:
            if lost.reason == "died":
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"roller {member.name} still answers {timeout_s:.0f} s after it was killed")


async def _drop_newer_samples(st, weight_version: int) -> int:
    """Drop every group in the TransferQueue with a token of weights newer than ``weight_version`` and re-issue
    its prompt (``Stages.reissue``); returns how many (metadata only)."""

    infos = await st.rt.tq.asample_info(PARTITION, None, limit=st.cfg.transferqueue.max_request_ids)
    by_uid: dict[str, list[dict]] = {}
    for info in infos:
        by_uid.setdefault(str(info["tags"][schema.UID]), []).append(info)
    newer = {uid: group for uid, group in by_uid.items()
             if any(int(s["tags"].get(schema.MAX_WEIGHT_VERSION, -1)) > weight_version for s in group)}
    for uid, group in newer.items():
        await st.reissue(uid, [s["id"] for s in group], REISSUED_NEWER_WEIGHTS, f"generated with weights newer "
                         f"than the restored weight_version {weight_version}")
    return len(newer)


async def _hand_back_taken_samples(st) -> None:
    """Make the samples the trainer's task had taken and not trained (the lost step's, and one-step-off's next
    batch) available to it again: every sample left in the partition is untrained."""
    await st.rt.tq.areset_consumption(PARTITION, TRAIN_TASK)
