"""The parts of a job checkpoint, each against real TransferQueue servers (no Ray): the feeder's data
position and re-issue, the buffered samples' round trip through the trainer side, the config check on
resume and the metrics kept. The whole save/kill/resume cycle is ``test_resume.py``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from common import schema
from controller.config import load_config, to_dict
from controller.feeder import PromptFeeder
from controller.job_checkpoint import check_resume_config, truncate_metrics
from trainers.sample_store import restore_samples, save_samples
from transferqueue.client import TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue
from transferqueue.records import BatchMeta

OVERRIDES = ["data.size=8", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=4",
             "rollout.n=2"]


@pytest.fixture(scope="module")
def tq():
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=1, capacity_bytes=64 * 1024**2))
    client = TQClient(servers.handle)
    yield servers.handle, client
    client.close()
    servers.shutdown()


def prompts_by_uid(client: TQClient, partition: str) -> dict[str, list[int]]:
    infos = client.sample_info(partition)
    meta = BatchMeta(partition, [i["id"] for i in infos], [], [i["tags"] for i in infos])
    data = client.get_data(meta, [schema.INPUT_IDS, schema.ATTENTION_MASK])
    out = {}
    for i, info in enumerate(infos):
        ids, mask = data[schema.INPUT_IDS][i], data[schema.ATTENTION_MASK][i]
        out[info["tags"][schema.UID]] = ids[mask.bool()].tolist()
    return out


def test_feeder_restore_continues_the_stream_and_reissues_any_issued_prompt(tq):
    handle, client = tq
    cfg = load_config(preset="tiny", overrides=OVERRIDES)
    first = PromptFeeder(cfg, 4, None, "feed-a")
    second = PromptFeeder(cfg, 4, None, "feed-b")
    first.connect(handle.to_dict())
    second.connect(handle.to_dict())
    try:
        check_feeders(client, first, second)
    finally:
        first.close()
        second.close()


def check_feeders(client: TQClient, first: PromptFeeder, second: PromptFeeder) -> None:
    assert [g["uid"] for g in first.feed(3)] == ["s0.p0", "s0.p1", "s1.p0"]
    state = json.loads(json.dumps(first.state()))  # as job.json keeps it
    assert state == {"num_fed": 3, "reissues": {}, "requeued": [], "exhausted": False}
    assert [g["uid"] for g in first.feed(1)] == ["s1.p1"]  # the uninterrupted stream, for comparison
    second.restore(state)
    assert [g["uid"] for g in second.feed(10)] == ["s1.p1", "s2.p0", "s2.p1", "s3.p0", "s3.p1"]
    assert second.state()["exhausted"]
    assert second.reissue(["s0.p1"]) == [{"uid": "s0.p1.r1", "global_step": 0}]  # issued by the first feeder
    prompts_a, prompts_b = prompts_by_uid(client, "feed-a"), prompts_by_uid(client, "feed-b")
    assert prompts_b["s0.p1.r1"] == prompts_a["s0.p1"]
    assert prompts_b["s1.p1"] == prompts_a["s1.p1"]  # the restored stream is the same stream
    with pytest.raises(ValueError, match="past the run's 4 batches"):
        second.restore({"num_fed": 9, "reissues": {}})
    with pytest.raises(ValueError, match="names no prompt"):
        second.reissue(["s9.p0"])
    check_requeue(second)


def check_requeue(feeder: PromptFeeder) -> None:
    """Requeued prompts (a trainer restart's superseded steps) are fed again first, under fresh uids, and kept
    in the data position; the stream is not exhausted while any waits."""
    feeder.requeue(["s1.p0", "s0.p1.r1"])
    state = json.loads(json.dumps(feeder.state()))
    assert state["requeued"] == ["s1.p0", "s0.p1"] and not state["exhausted"]
    with pytest.raises(ValueError, match="names no prompt"):
        feeder.requeue(["s1.p1", "s9.p0"])
    assert feeder.state()["requeued"] == ["s1.p0", "s0.p1"]  # nothing queued by the refused call
    assert [g["uid"] for g in feeder.feed(1)] == ["s1.p0.r1"]
    feeder.restore(state)  # the queue is part of the data position
    assert [g["uid"] for g in feeder.feed(5)] == ["s1.p0.r1", "s0.p1.r2"]  # then the exhausted stream: nothing
    assert feeder.state()["exhausted"]


def test_buffered_samples_round_trip_with_their_tags_and_no_ground_truth(tq, tmp_path):
    handle, client = tq
    prompt = {schema.INPUT_IDS: torch.tensor([[0, 5, 6], [0, 5, 6]]), schema.ATTENTION_MASK: torch.tensor([[0, 1, 1]] * 2),
              schema.GROUND_TRUTH: ['{"a": 1}', '{"a": 1}']}
    meta = client.put(prompt, "buf", tags=[{schema.UID: "s0.p0"}] * 2)
    responses = [torch.tensor([7, 8, 9]), torch.tensor([7])]  # different lengths: each sample keeps its own
    tags = [{schema.MIN_WEIGHT_VERSION: 3, schema.MAX_WEIGHT_VERSION: 4, schema.REWARD: 0.5}] * 2
    client.put({schema.RESPONSES: responses, schema.ROLLOUT_LOG_PROBS: [r.float() / -10 for r in responses]}, "buf",
               sample_ids=meta.sample_ids, tags=tags)
    infos = client.sample_info("buf")
    worker = SimpleNamespace(rank=0, tq_handle=handle.to_dict(), _tq_client=None)
    wire = BatchMeta("buf", [i["id"] for i in infos], [], [i["tags"] for i in infos]).to_wire()
    fields = [schema.INPUT_IDS, schema.RESPONSES, schema.ROLLOUT_LOG_PROBS, schema.GROUND_TRUTH]
    assert save_samples(worker, wire, fields, str(tmp_path / "samples")) > 0
    assert save_samples(SimpleNamespace(rank=1), wire, fields, str(tmp_path / "other")) == 0  # rank 0 only
    client.clear("buf")

    uids = restore_samples(worker, str(tmp_path / "samples"), "buf2", fields[:3])
    assert uids == ["s0.p0", "s0.p0"]
    restored = client.sample_info("buf2")
    assert [i["tags"] for i in restored] == [i["tags"] for i in infos]  # weight versions kept
    assert all(schema.GROUND_TRUTH not in i["fields"] for i in restored)  # no roller takes them again
    data = client.get_data(BatchMeta("buf2", [i["id"] for i in restored], [], []), fields[:3])
    for i, response in enumerate(responses):
        assert torch.equal(data[schema.RESPONSES][i], response)
        assert torch.equal(data[schema.ROLLOUT_LOG_PROBS][i], response.float() / -10)
    with pytest.raises(ValueError, match="lack fields"):
        restore_samples(worker, str(tmp_path / "samples"), "buf3", [schema.TOKEN_LEVEL_SCORES])
    worker._tq_client.close()


def test_resume_config_check_names_the_keys_that_break_promises():
    saved = to_dict(load_config(preset="tiny", overrides=OVERRIDES))
    harmless = to_dict(load_config(preset="tiny", overrides=[
        *OVERRIDES, "trainer.total_steps=3", "rollers.num_replicas=2", "metrics.progress=false", "data.epochs=2"]))
    assert check_resume_config(saved, harmless) == ["data.epochs", "metrics.progress", "rollers.num_replicas",
                                                    "trainer.total_steps"]
    changed = to_dict(load_config(preset="tiny", overrides=[*OVERRIDES, "rollout.n=4", "data.seed=1",
                                                            "algorithm.max_staleness=3"]))
    with pytest.raises(ValueError, match=r"changed algorithm.max_staleness, data.seed, rollout.n \("):
        check_resume_config(saved, changed)


def test_a_config_saved_before_a_key_existed_reads_the_value_the_run_had():
    """A checkpoint's config written before a key existed (here data.val_disjoint, a48c431, and
    metrics.dump_every) reads it as the run had it: the value of ``VALUES_BEFORE_THE_KEY`` (held out by row
    before a48c431: false) or the default, not None. With no held-out prompts the training rows are the same
    whatever data.val_disjoint says, so the resume goes ahead naming it."""
    current = to_dict(load_config(preset="tiny", overrides=OVERRIDES))
    saved = json.loads(json.dumps(current))
    del saved["data"]["val_disjoint"], saved["metrics"]["dump_every"]
    assert check_resume_config(saved, current) == ["data.val_disjoint"]


def write_rows(path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


def test_held_out_prompts_may_change_on_resume_only_where_the_training_rows_stay():
    """data.val_size / val_file / val_disjoint choose the held-out prompts. A procedural task trains on its
    first data.size rows whatever they are: a change is allowed."""
    def tree(*extra: str) -> dict:
        return to_dict(load_config(preset="tiny", overrides=[*OVERRIDES, *extra]))

    assert check_resume_config(tree(), tree("data.val_size=2", "data.val_disjoint=false")) == [
        "data.val_disjoint", "data.val_size"]
    assert check_resume_config(tree("data.val_size=2", "data.val_disjoint=false"), tree()) == [
        "data.val_disjoint", "data.val_size"]


def test_a_file_tasks_held_out_rows_are_fixed_on_resume(tmp_path):
    """A file task gives its held-out rows up from training: a change that moves them is refused, one that
    leaves the training rows as they were is not (a pre-a48c431 run held out by row: val_disjoint=false)."""
    distinct = write_rows(tmp_path / "distinct.jsonl", [f"what is {i} + 1?" for i in range(12)])
    repeats = write_rows(tmp_path / "repeats.jsonl", [f"what is {i} + 1?" for i in range(10)] + ["what is 9 + 1?"])

    def tree(task: str, *extra: str, before_a48c431: bool = False) -> dict:
        out = to_dict(load_config(preset="tiny", overrides=[*OVERRIDES, f"data.task={task}", *extra]))
        if before_a48c431:
            del out["data"]["val_disjoint"]
        return out

    with pytest.raises(ValueError, match=r"changed data.val_size \(data.val_size: 0 -> 2\).*taken out of the training"):
        check_resume_config(tree(distinct), tree(distinct, "data.val_size=2"))
    # Held out by row before a48c431; by text now: the same rows when the file repeats none of its last ones...
    assert check_resume_config(tree(distinct, "data.val_size=2", before_a48c431=True),
                               tree(distinct, "data.val_size=2")) == ["data.val_disjoint"]
    # ... other training rows when it does (its last row repeats a training prompt): keep the run's split.
    with pytest.raises(ValueError, match=r"data.val_disjoint: False -> True"):
        check_resume_config(tree(repeats, "data.val_size=2", before_a48c431=True), tree(repeats, "data.val_size=2"))
    assert check_resume_config(tree(repeats, "data.val_size=2", before_a48c431=True),
                               tree(repeats, "data.val_size=2", "data.val_disjoint=false")) == []


def test_truncate_metrics_keeps_the_rows_up_to_the_checkpoint(tmp_path):
    rows = [{"step": s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "cut')
    assert truncate_metrics(tmp_path, 2) == rows[:2]
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in rows[:2]]
    assert json.loads((tmp_path / "metrics.superseded.jsonl").read_text()) == {"step": 3}


def test_a_cancelled_update_finishes_before_the_cancellation_takes_effect():
    from controller.stages import _finish_before_cancel

    done = []

    async def step():
        await asyncio.sleep(0.2)
        done.append("trained")
        return 1

    async def main():
        task = asyncio.ensure_future(_finish_before_cancel(step()))
        await asyncio.sleep(0.05)
        task.cancel()  # a stop signal, twice (it is re-sent each second)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done == ["trained"]  # the step ran to its end: trainer and controller agree on the step
        assert await _finish_before_cancel(step()) == 1

    asyncio.run(main())


# ------------------------------------------------------------------------ buffered samples across settings

# Settings that change what a sample carries or who reads it: generation dumps (``response_text``, read by the
# dump), validation (a second source of groups in the rollers' channel), DAPO dynamic sampling, the agent loop
# (multi-turn trajectories), ReMax (the estimator's roller extra ``remax_baseline``), and all of them at once.
AGENT = ("rollout.environment=tests.rollers.agent_envs:scripted_turns", "rollout.max_turns=3",
         "rollout.max_response_length=12")
SETTINGS = {
    "defaults": (),
    "dumps": ("metrics.dump_every=1",),
    "validation": ("data.val_size=2", "trainer.val_every=1"),
    "dynamic_sampling": ("algorithm.dynamic_sampling=true",),
    "agent_loop": AGENT,
    "remax": ("algorithm.adv_estimator=remax",),
    "all": ("metrics.dump_every=1", "data.val_size=2", "trainer.val_every=1", "algorithm.dynamic_sampling=true",
            *AGENT, "algorithm.adv_estimator=remax"),
}


class _LocalTrainer:
    """``TrainerGroup.execute`` on one in-process rank 0 (what moves buffered samples: trainers/sample_store)."""

    def __init__(self, handle):
        self.worker = SimpleNamespace(rank=0, tq_handle=handle.to_dict(), _tq_client=None)

    def execute(self, fn, *args):
        return [fn(self.worker, *args)]


def _generate_one_group(cfg, handle) -> None:
    """One group generated as this run's rollers do (the runtime's channel and ReMax setting, the real
    ``Roller`` on the tiny model), from the prompt row the feeder put."""
    from common.models import load_model, load_tokenizer
    from controller.layout import sample_fields
    from controller.runtime import roller_channel
    from controller.tasks import resolve_reward
    from rollers.rewards import build_reward_fn
    from rollers.roller import Roller
    from rollers.torch_engine import TorchEngine

    async def scenario():
        tok = load_tokenizer(cfg.model)
        engine = TorchEngine(load_model(cfg.model), tok, max_batch_slots=4, seed=cfg.rollout.seed)
        channel = roller_channel(cfg, handle.to_dict())()
        try:
            roller = Roller(engine, tok, build_reward_fn(resolve_reward(cfg.rollout.reward, cfg.data.task)),
                            cfg.rollout, channel, remax_baseline=schema.REMAX_BASELINE in sample_fields(cfg),
                            poll_timeout_s=0.05)
            assert await asyncio.wait_for(roller.run(max_groups=1), 60) == 1
        finally:
            await engine.shutdown()
            channel.client.close()

    asyncio.run(scenario())


def _reads(cfg, client: TQClient, feeder: PromptFeeder, meta: BatchMeta) -> dict:
    """What the run reads of the samples of ``meta`` when it trains them: the trainer's batch (with the
    estimator's roller extras) and, on a dumped step, the generation dump's rows."""
    from controller.generations import GenerationDump
    from trainers.advantages import ADV_ESTIMATORS
    from trainers.tq_batch import fetch_batch

    reads = {"trainer": fetch_batch(client, meta, ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).roller_extras)}
    if GenerationDump("", cfg.metrics.dump_every, None).due(1):
        reads["dump"] = feeder.dump_rows(meta)
    return reads


def _assert_equal(before, after, where: str = "") -> None:
    if isinstance(before, torch.Tensor):
        assert torch.equal(before, after), where
    elif isinstance(before, dict):
        assert set(before) == set(after), where
        for key in before:
            _assert_equal(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, list):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            _assert_equal(b, a, f"{where}[{i}]")
    else:
        assert before == after, where


@pytest.mark.timeout(180)
@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_buffered_groups_come_back_with_what_every_reader_of_the_run_reads(tq, tmp_path, settings):
    """Issue 44, item 3: a job checkpoint saves a buffered group with every field the run's rollers put, so
    after a resume the schedule sees it ready, and the trainer and the generation dump read of it exactly
    what they would have read without the stop. (Before: ``metrics.dump_every=1`` failed on resume with
    ``get: field 'response_text' missing``: the checkpoint kept only the trainer's fields.)"""
    from controller.job_checkpoint import JobCheckpointer
    from controller.layout import PARTITION, PROMPT_PARTITION, TRAIN_TASK
    from controller.stages import TRAIN_FIELDS
    from controller.validation import VAL_PROMPT_PARTITION

    handle, client = tq
    cfg = load_config(preset="tiny", overrides=[*OVERRIDES, "rollout.max_response_length=4", *settings,
                                                f"run_dir={tmp_path}"])
    feeder = PromptFeeder(cfg, 4, None, PROMPT_PARTITION, VAL_PROMPT_PARTITION if cfg.data.val_size else "")
    feeder.connect(handle.to_dict())
    trainer = _LocalTrainer(handle)
    try:
        assert [g["uid"] for g in feeder.feed(1)] == ["s0.p0"]
        _generate_one_group(cfg, handle)
        infos = client.sample_info(PARTITION)
        before = _reads(cfg, client, feeder, BatchMeta(PARTITION, [i["id"] for i in infos], [], [i["tags"] for i in infos]))

        checkpointer = JobCheckpointer(cfg)
        st = SimpleNamespace(rt=SimpleNamespace(tq=client, trainer=trainer), n=cfg.rollout.n)
        buffered, in_flight, num_bytes = checkpointer.save_samples(st, tmp_path / "samples")
        assert sorted(buffered.sample_ids) == sorted(i["id"] for i in infos) and in_flight == [] and num_bytes > 0
        client.clear(PARTITION)  # a resumed job starts with an empty TransferQueue
        assert checkpointer.restore_samples(st, tmp_path / "samples") == ["s0.p0"] * cfg.rollout.n

        meta = client.get_meta(TRAIN_FIELDS, cfg.rollout.n, TRAIN_TASK, PARTITION, sampler="group_complete",
                               options={"group_size": cfg.rollout.n}, timeout_s=10)
        assert len(meta) == cfg.rollout.n  # the schedule sees the whole group ready
        _assert_equal(before, _reads(cfg, client, feeder, meta))
    finally:
        feeder.close()
        if trainer.worker._tq_client is not None:
            trainer.worker._tq_client.close()
        for partition in (PARTITION, PROMPT_PARTITION):  # the next settings' run starts from an empty queue
            client.clear(partition)
