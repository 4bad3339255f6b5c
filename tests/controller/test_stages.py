"""The schedule's stages driven with stand-ins for the pools (no Ray): what they count and log."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from types import SimpleNamespace

import pytest

from common import schema
from controller.config import load_config
from controller.metrics import JobMetrics
from controller.report import RunReport
from controller.stages import RolloutFailure, Stages
from transferqueue.records import BatchMeta


class _FakeTQ:
    """The controller's TransferQueue client: hands out whole groups of ready samples."""

    def __init__(self, groups: list[list[dict]]):
        self.groups, self.next_id = list(groups), 0

    async def aget_meta(self, fields, batch_size, task, partition, **kwargs):
        tags = self.groups.pop(0) if self.groups else []  # none ready: the poll comes back empty
        ids = list(range(self.next_id, self.next_id + len(tags)))
        self.next_id += len(tags)
        return BatchMeta(partition, ids, list(fields), tags)

    async def aclear(self, partition, sample_ids):
        return None


class _FakeTrainer:
    def train_step(self, meta):
        return {"actor/pg_loss": 0.0}


class _FakePool:
    def size(self):
        return 1


class _FakeRuntime:
    def __init__(self, groups):
        self.tq, self.trainer, self.pool = _FakeTQ(groups), _FakeTrainer(), _FakePool()


def _group(uid: str, n: int, version: int = 0) -> list[dict]:
    return [{schema.UID: uid, schema.MIN_WEIGHT_VERSION: version, schema.MAX_WEIGHT_VERSION: version,
             "reward": float(i % 2), schema.RESPONSE_LENGTH: 3, schema.FINISH_REASON: "stop"} for i in range(n)]


def _stages(tmp_path, groups, *overrides, mode="sync"):
    cfg = load_config(mode=mode, preset="tiny", overrides=["data.train_batch_size=2", "trainer.ppo_mini_batch_size=2",
                                                             f"run_dir={tmp_path}", "metrics.progress=false",
                                                             *overrides])
    metrics, report = JobMetrics(), RunReport(tmp_path, total_steps=2, progress=False)
    return Stages(cfg, _FakeRuntime(groups), metrics, report), metrics, report


def test_stages_count_samples_where_they_are_seen(tmp_path):
    """Samples the controller takes from the TransferQueue count as produced at once (the rollers' own
    count is only polled every 2 s), so produced >= consumed + dropped at every moment; the sample-age
    histogram has one observation per trained sample, like consumed."""
    n = 8  # rollout.n of the tiny preset
    st, metrics, report = _stages(tmp_path, [_group(f"u{i}", n) for i in range(4)])
    get = metrics.registry.get_sample_value

    async def steps():
        for step in range(2):
            meta = await st.generate(2, train_weight_version=st.ledger.weight_version)
            assert get("hflow_samples_produced_total") == 2 * n * (step + 1)
            assert get("hflow_samples_consumed_total") == 2 * n * step
            await st.update(meta)
            assert get("hflow_samples_consumed_total") == 2 * n * (step + 1) == get("hflow_samples_produced_total")
            assert get("hflow_sample_age_seconds_count") == get("hflow_samples_consumed_total")
            assert get("hflow_queue_lag_count") == get("hflow_response_length_count") == 2 * n * (step + 1)
            assert get("hflow_accuracy_ratio") == get("hflow_reward_mean") == 0.5  # rewards alternate 0, 1

    asyncio.run(steps())
    report.close()


def test_trainer_wait_is_counted_as_it_passes_and_never_runs_ahead_of_the_clock(tmp_path):
    """``hflow_trainer_wait_seconds_total``, whose rate is the dashboard's trainer idle share: a scrape during a
    wait sees the wait so far; no span between two scrapes holds more idle seconds than it lasts (a wait was
    booked whole when it ended: the panel read 1.3 there, and 0 while the trainer waited); a job checkpoint
    is the trainer's work, not a wait for data (it was counted as one)."""
    wait_s, save_s = 0.3, 0.3
    st, metrics, report = _stages(tmp_path, [_group(f"u{i}", 8) for i in range(6)])
    st.checkpointer.due = lambda step: step == 2

    async def save(stages, reason):
        await asyncio.sleep(save_s)

    st.checkpointer.save = save
    scrapes = []

    def scrape():  # (a time before the read, the count, a time after it)
        before = time.monotonic()
        count = metrics.registry.get_sample_value("hflow_trainer_wait_seconds_total")
        scrapes.append((before, count, time.monotonic()))

    async def steps():
        scrape()
        for _ in range(3):
            await asyncio.sleep(wait_s)  # the trainer waits for data
            scrape()
            await st.update(await st.generate(2, train_weight_version=st.ledger.weight_version))
            scrape()

    asyncio.run(steps())
    report.close()
    # Between two scrapes: (the least and the most time that passed between their reads, the count's increase).
    spans = [(b1 - a0, a1 - b0, c1 - c0) for (b0, c0, a0), (b1, c1, a1) in itertools.pairwise(scrapes)]
    for least, _, counted in spans[0::2]:  # waiting all along
        assert counted >= least >= wait_s, spans
    for _, most, counted in spans:
        assert counted <= most, spans
    _, most, counted = spans[3]  # step 2: its update and its checkpoint
    assert counted <= most - save_s, spans


def test_a_short_step_is_logged_with_its_reason(tmp_path, caplog):
    st, _, report = _stages(tmp_path, [_group("u0", 8), _group("u1", 8), _group("u2", 8)])

    st.ledger.adopt(["u0", "u1", "u2"])  # three groups admitted

    async def steps():
        await st.update(await st.generate(2, train_weight_version=0))  # a full step: no line
        st.ledger.out_of_data()  # the feeder had one prompt left for step 2
        await st.update(await st.generate(1, train_weight_version=1))

    with caplog.at_level(logging.WARNING, logger="controller.stages"):
        asyncio.run(steps())
    report.close()
    lines = [r.getMessage() for r in caplog.records if "prompt groups" in r.getMessage()]
    assert lines == ["step 2 trains 1 of 2 prompt groups: the prompt data has no more: a final partial batch "
                     "(data.drop_last=true drops it instead)"]


def test_failed_groups_count_once_toward_the_step_that_sees_them(tmp_path):
    """sync / one-step-off with ``rollers.on_failed_group=skip``: failed groups leave the ledger's
    ``outstanding`` when they are found, and the step that finds them counts them all (the next step's batch
    is sized from ``outstanding``, so a failure carried over to it would count twice): after a step that
    trained one group and saw three fail, nothing is outstanding or left to claim, no slot was released (these
    schedules do not replace failed groups), and the next batch is all fresh groups."""
    st, _, report = _stages(tmp_path, [_group("u0", 8), []], "rollers.on_failed_group=skip")
    st.ledger.adopt(["u0", "f0", "f1", "f2"])  # after a resume: four groups admitted
    real_skip = st._skip

    async def check_rollers():
        if st.ledger.counts()["num_failed_groups"]:
            return 0
        failed = [SimpleNamespace(uid=f"f{i}", stage="reward", errors=["boom"], prompt_id=i) for i in range(3)]
        await real_skip(failed)
        return len(failed)

    st.check_rollers = check_rollers

    async def step():
        meta = await st.generate(2, train_weight_version=0)
        assert [t[schema.UID] for t in meta.tags] == ["u0"] * 8
        await st.update(meta)

    asyncio.run(step())
    report.close()
    assert st.ledger.outstanding == 0 and st.num_unclaimed_skips == 0 and st.ledger.to_state()["released"] == 0
    assert st.ledger.counts()["num_failed_groups"] == 3
    assert st.last_failure == "group f2 failed in reward: boom"  # what a fully-async give-up would quote


def test_fully_async_waits_for_replacements_and_fails_when_they_keep_failing(tmp_path):
    """fully-async: a failed group does not count toward the step (a fresh prompt takes its place), so the
    step waits for whole groups; with none succeeding, the run fails after MIN_FAILED_IN_A_ROW failures."""
    st, _, report = _stages(tmp_path, [[], _group("u0", 8), _group("u1", 8)], "rollers.on_failed_group=skip",
                            mode="fully-async")

    async def check_rollers(failed=5):
        st.num_unclaimed_skips += failed
        st.last_failure = "group s0.p9 failed in reward: KeyError: 'nope'"
        return failed

    st.check_rollers = check_rollers

    async def steps():
        meta = await st.generate(2, train_weight_version=0)  # 5 failures, then two whole groups: a full step
        assert sorted({t[schema.UID] for t in meta.tags}) == ["u0", "u1"] and st.failed_in_a_row == 0
        with pytest.raises(RolloutFailure, match="20 groups in a row failed.*the last: group s0.p9 failed in reward: KeyError: 'nope'"):
            await asyncio.wait_for(st.generate(2, train_weight_version=1), timeout=5)

    asyncio.run(steps())
    report.close()
