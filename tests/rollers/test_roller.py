"""The roller: outputs → schema tensors, the generate → score → put loop, failures, admission, partial
rollout, metrics, and the Ray actor wrapper (real processes)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from common import schema
from common.models import ModelConfig, apply_chat_template, load_tokenizer
from rollers.config import RollersConfig, RolloutConfig
from rollers.engine import Engine, EngineError, GenerationOutput, GenerationRequest
from rollers.rewards import tiny_repeat_reward
from rollers.roller import (
    REWARD_BASELINES,
    GroupResult,
    PromptGroup,
    Roller,
    build_response_fields,
    sample_seed,
)
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import (
    LocalGroupChannel,
    PermitAdmission,
    PermitChannel,
    concurrency_probe,
    run,
    spiced_tiny,
)

N = 4




@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="module")
def model():
    return spiced_tiny()


def make_group(tok, i: int, n: int = N) -> PromptGroup:
    symbol = "abcdefgh"[i % 8]
    ids = tuple(apply_chat_template(tok, f"repeat the word {symbol}"))
    return PromptGroup(f"uid{i}", i, n, ids, {"answer": symbol})


def out(ids, reason="stop", versions=None, rid="r") -> GenerationOutput:
    return GenerationOutput(rid, list(ids), [-0.5] * len(ids), versions or [0] * len(ids), reason)


# --------------------------------------------------------------------------- build_response_fields


def test_response_mask_excludes_pads_when_pad_is_eos():
    eos = pad = 2
    fields = build_response_fields([out([7, 8, eos]), out([9, 10, 11, 12, 13], "length")], [1.0, 0.25],
                                   pad_token_id=pad, pad_to=5)
    assert fields[schema.RESPONSES][0].tolist() == [7, 8, eos, pad, pad]
    assert fields[schema.RESPONSE_MASK].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert fields[schema.TOKEN_LEVEL_SCORES].tolist() == [[0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0.25]]
    assert fields[schema.ROLLOUT_LOG_PROBS][0].tolist() == [-0.5, -0.5, -0.5, 0, 0]
    assert fields[schema.RESPONSE_LENGTH].tolist() == [3, 5]
    assert fields[schema.FINISH_REASON] == ["stop", "length"]
    assert fields[schema.RESPONSES].dtype == torch.int64 and fields[schema.ROLLOUT_LOG_PROBS].dtype == torch.float32


def test_response_fields_versions_and_default_width():
    fields = build_response_fields([out([1, 2], versions=[3, 4]), out([5], versions=[4])], [0.0, 1.0], 0)
    assert fields[schema.RESPONSES].shape == (2, 2)  # the group's longest
    assert fields[schema.MIN_WEIGHT_VERSION].tolist() == [3, 4]
    assert fields[schema.MAX_WEIGHT_VERSION].tolist() == [4, 4]


@pytest.mark.parametrize(
    "outputs, scores, pad_to, match",
    [
        ([out([1, 2, 3])], [1.0], 2, "more than pad_to=2"),
        ([out([], "stop")], [1.0], None, "need >= 1 token"),
        ([out([1], None)], [1.0], None, "finish_reason=None"),
        ([out([1]), out([2])], [1.0], None, "one score per output"),
        ([GenerationOutput("x", [1, 2], [0.0], [0, 0], "stop")], [1.0], None, "1 log-probs"),
    ],
)
def test_response_fields_reject_bad_outputs(outputs, scores, pad_to, match):
    with pytest.raises(ValueError, match=match):
        build_response_fields(outputs, scores, 0, pad_to)


def test_sample_seed_is_stable_and_distinct():
    assert sample_seed(0, "u", 1) == sample_seed(0, "u", 1)
    seeds = {sample_seed(0, "u", i) for i in range(4)} | {sample_seed(1, "u", 0), sample_seed(0, "v", 0)}
    assert len(seeds) == 6 and all(0 <= s < 2**62 for s in seeds)
    assert sample_seed(0, "u", 0, num_prefix_tokens=3) != sample_seed(0, "u", 0)


# ------------------------------------------------------------------------------------ the roller loop


async def _roll(model, tok, groups, reward_fn=tiny_repeat_reward, slots=16, max_seq_len=None, **kwargs):
    """Run a roller with a TorchEngine over ``groups``; returns (results by uid, roller)."""
    rollout = kwargs.pop("rollout", RolloutConfig(n=N, max_response_length=6, seed=3))
    engine = TorchEngine(model, tok, max_batch_slots=slots, max_seq_len=max_seq_len)
    channel = LocalGroupChannel()
    for group in groups:
        channel.groups.put_nowait(group)
    roller = Roller(engine, tok, reward_fn, rollout, channel,
                    max_groups_in_flight=max(1, slots // N), poll_timeout_s=0.05, **kwargs)
    try:
        await roller.run(max_groups=len(groups))
    finally:
        await engine.shutdown()
    results = {}
    while not channel.results.empty():
        result = channel.results.get_nowait()
        results[result.uid] = result
    return results, roller


def test_roller_puts_schema_fields_for_every_group(model, tok):
    groups = [make_group(tok, i) for i in range(3)]
    results, roller = run(_roll(model, tok, groups))
    assert sorted(results) == ["uid0", "uid1", "uid2"]
    eos = tok.eos_token_id
    for group in groups:
        result = results[group.uid]
        fields = result.fields
        assert result.group is group
        responses, mask = fields[schema.RESPONSES], fields[schema.RESPONSE_MASK]
        assert responses.shape[0] == N and responses.shape == mask.shape
        assert responses.shape[1] <= 6
        for row in range(N):
            length = int(fields[schema.RESPONSE_LENGTH][row])
            assert mask[row].tolist() == [1] * length + [0] * (responses.shape[1] - length)
            reason = fields[schema.FINISH_REASON][row]
            assert (reason == "stop") == (int(responses[row, length - 1]) == eos)
            assert reason == "stop" or length == 6
            assert fields[schema.TOKEN_LEVEL_SCORES][row, length - 1] == result.rewards[row]
            assert fields[schema.TOKEN_LEVEL_SCORES][row].sum() == result.rewards[row]
            assert (fields[schema.ROLLOUT_LOG_PROBS][row, :length] <= 0).all()
        assert fields[schema.MIN_WEIGHT_VERSION].tolist() == [0] * N
    # n samples of a prompt differ (per-sample seeds)
    distinct = sum(len({tuple(r.fields[schema.RESPONSES][i].tolist()) for i in range(N)}) > 1
                   for r in results.values())
    assert distinct >= 2
    stats = roller.stats()
    assert stats["num_groups"] == 3 and stats["num_samples"] == 3 * N
    assert stats["tokens_per_s"] > 0 and 0 < stats["busy_ratio"] <= 1 and stats["requests_in_flight"] == 0
    truncated = sum(r.fields[schema.FINISH_REASON].count("length") for r in results.values())
    assert stats["truncation_ratio"] == pytest.approx(truncated / (3 * N))
    assert 1 <= stats["response_length_min"] <= stats["response_length_mean"] <= stats["response_length_max"] <= 6


def test_waiting_groups_start_together_in_one_prefill(model, tok):
    """Groups already waiting start with the one just taken, so the engine admits them all in one prefill
    forward (rows right-padded to the longest prompt; each group's n identical prompts prefilled once)."""
    groups = [PromptGroup(f"uid{i}", i, N,
                          tuple(apply_chat_template(tok, "repeat the word" + " a" * (i + 1))), {"answer": "a"})
              for i in range(3)]
    lengths = {len(g.input_ids) for g in groups}
    results, roller = run(_roll(model, tok, groups))
    assert sorted(results) == ["uid0", "uid1", "uid2"] and len(lengths) == 3
    assert roller.engine.stats()["num_prefill_tokens"] == 3 * max(lengths)  # one by one: sum(lengths)


def test_same_seeds_give_same_samples_whatever_the_batch(model, tok):
    target = make_group(tok, 5)
    alone, _ = run(_roll(model, tok, [target], slots=4))
    crowded, _ = run(_roll(model, tok, [make_group(tok, i) for i in range(3)] + [target], slots=16))
    assert torch.equal(alone["uid5"].fields[schema.RESPONSES], crowded["uid5"].fields[schema.RESPONSES])
    torch.testing.assert_close(alone["uid5"].fields[schema.ROLLOUT_LOG_PROBS],
                               crowded["uid5"].fields[schema.ROLLOUT_LOG_PROBS], rtol=0, atol=1e-5)


def test_reward_raising_for_one_group_fails_only_that_group(model, tok):
    groups = [make_group(tok, i) for i in range(4)]

    def reward(text, gt):
        if gt["answer"] == "c":  # group uid2
            raise RuntimeError("checker crashed")
        return tiny_repeat_reward(text, gt)

    results, roller = run(_roll(model, tok, groups, reward_fn=reward))
    assert sorted(results) == ["uid0", "uid1", "uid3"]
    failures = roller.drain_failures()
    assert [f.uid for f in failures] == ["uid2"] and failures[0].stage == "reward"
    assert failures[0].prompt_id == groups[2].prompt_id
    assert len(failures[0].errors) == N and "RuntimeError: checker crashed" in failures[0].errors[0]
    stats = roller.stats()
    assert stats["num_failed_groups"] == 1 and stats["num_failed_rewards"] == N and stats["num_groups"] == 3
    assert roller.drain_failures() == []


def test_nan_reward_fails_the_group_never_zero(model, tok):
    results, roller = run(_roll(model, tok, [make_group(tok, 0)], reward_fn=lambda t, g: math.nan))
    assert results == {}
    (failure,) = roller.drain_failures()
    assert "nan" in failure.errors[0]


def test_hanging_reward_times_out_and_the_pipeline_continues(model, tok):
    release = threading.Event()

    def slow(text, gt):
        if gt["answer"] == "a":
            release.wait(30)  # hangs until the test ends
        return 1.0

    rollout = RolloutConfig(n=N, max_response_length=4, reward_timeout_s=0.5)
    start = time.perf_counter()
    try:
        results, roller = run(_roll(model, tok, [make_group(tok, 0), make_group(tok, 1)], reward_fn=slow,
                                    rollout=rollout))
        assert time.perf_counter() - start < 20  # did not wait for the hanging call
    finally:
        release.set()
    assert sorted(results) == ["uid1"]
    assert "reward_timeout_s" in roller.drain_failures()[0].errors[0]


def test_async_reward_scores_single_turn_groups_like_multi_turn(model, tok):
    """An ``async def`` reward scores single-turn groups (its coroutine used to be taken for a non-number:
    every group failed), with at most ``rollout.reward_max_concurrency`` calls at once."""
    reward, probe = concurrency_probe(tiny_repeat_reward, 0.01)
    rollout = RolloutConfig(n=N, max_response_length=6, seed=3, reward_max_concurrency=2)
    async_results, roller = run(_roll(model, tok, [make_group(tok, i) for i in range(2)], reward_fn=reward,
                                      rollout=rollout))
    sync_results, _ = run(_roll(model, tok, [make_group(tok, i) for i in range(2)], rollout=rollout))
    assert roller.drain_failures() == [] and sorted(async_results) == ["uid0", "uid1"]
    assert {u: r.rewards for u, r in async_results.items()} == {u: r.rewards for u, r in sync_results.items()}
    assert probe.peak == 2


def test_remax_puts_the_greedy_baseline_reward(model, tok):
    group = make_group(tok, 0)
    greedy_text_reward = {}

    def reward(text, gt):
        greedy_text_reward.setdefault(text, tiny_repeat_reward(text, gt) + 0.5)
        return greedy_text_reward[text]

    results, _ = run(_roll(model, tok, [group], reward_fn=reward, remax_baseline=True))
    baseline = results["uid0"].fields[REWARD_BASELINES]
    assert baseline.shape == (N,) and len(set(baseline.tolist())) == 1
    assert baseline[0].item() in (0.5, 1.5)
    assert len(results["uid0"].rewards) == N


# ------------------------------------------------------------------------------------ admission


def test_permits_gate_group_starts(model, tok):
    async def scenario():
        engine = TorchEngine(model, tok, max_batch_slots=8)
        channel = LocalGroupChannel()
        for i in range(3):
            channel.groups.put_nowait(make_group(tok, i))
        admission = PermitAdmission()
        roller = Roller(engine, tok, tiny_repeat_reward, RolloutConfig(n=N, max_response_length=4),
                        PermitChannel(channel, admission), poll_timeout_s=0.05)
        task = asyncio.create_task(roller.run())
        await asyncio.sleep(0.3)
        assert channel.results.empty() and channel.groups.qsize() == 3  # no permit, nothing taken
        admission.grant(2)
        first = await asyncio.wait_for(channel.results.get(), 30)
        second = await asyncio.wait_for(channel.results.get(), 30)
        await asyncio.sleep(0.3)
        assert channel.groups.qsize() == 1 and admission.permits == 0
        roller.stop()
        await asyncio.wait_for(task, 10)
        await engine.shutdown()
        return {first.uid, second.uid}

    assert run(scenario()) == {"uid0", "uid1"}
    with pytest.raises(ValueError, match="num_groups >= 0"):
        PermitAdmission().grant(-1)


# ------------------------------------------------------------------------------------ partial rollout


class ScriptedEngine(Engine):
    """Returns scripted outputs in order and records the requests it got (for abort/resubmit logic)."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        self.version = 0

    @property
    def weight_version(self):
        return self.version

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        self.requests.append(request)
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        ids, versions, reason = item
        return GenerationOutput(request.request_id, list(ids), [-1.0] * len(ids), list(versions), reason)

    def stream(self, request):
        raise NotImplementedError

    async def pause(self, mode="retract"):
        pass

    async def resume(self):
        pass

    async def load_weights(self, named_tensors, weight_version):
        pass

    async def flush_cache(self):
        pass

    async def health(self):
        return True

    async def shutdown(self):
        pass


def _scripted_roller(tok, script, **rollout_kwargs):
    engine = ScriptedEngine(script)
    channel = LocalGroupChannel()
    rollout = RolloutConfig(n=1, max_response_length=8, temperature=1.0, **rollout_kwargs)
    roller = Roller(engine, tok, lambda t, g: 1.0, rollout, channel,
                    poll_timeout_s=0.05)
    return engine, channel, roller


def test_aborted_sample_is_resubmitted_with_its_prefix(tok):
    eos = tok.eos_token_id
    engine, channel, roller = _scripted_roller(tok, [([10, 11, 12], [0, 0, 0], "abort"), ([13, eos], [1, 1], "stop")])
    group = make_group(tok, 0, n=1)
    result = run(roller.process_group(group))
    first, second = engine.requests
    assert second.input_ids == group.input_ids + (10, 11, 12)
    assert second.sampling.max_new_tokens == 8 - 3
    assert first.sampling.seed != second.sampling.seed
    assert isinstance(result, GroupResult)
    fields = result.fields
    assert fields[schema.RESPONSES][0].tolist() == [10, 11, 12, 13, eos]
    assert fields[schema.MIN_WEIGHT_VERSION].tolist() == [0] and fields[schema.MAX_WEIGHT_VERSION].tolist() == [1]
    assert fields[schema.FINISH_REASON] == ["stop"]
    assert roller.stats()["num_resubmits"] == 1


def test_pad_to_max_length(tok):
    engine, channel, roller = _scripted_roller(tok, [([5, 6], [0, 0], "stop")])
    roller.pad_to_max_length = True
    result = run(roller.process_group(make_group(tok, 0, n=1)))
    assert result.fields[schema.RESPONSES].shape == (1, 8)  # rollout.max_response_length
    assert result.fields[schema.RESPONSE_MASK].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]


def test_too_many_aborts_fail_the_group(tok):
    engine, channel, roller = _scripted_roller(tok, [([10], [0], "abort")] * 3, max_resubmits=2)
    failure = run(roller.process_group(make_group(tok, 0, n=1)))
    assert failure.stage == "generate" and "rollout.max_resubmits" in failure.errors[0]
    assert len(engine.requests) == 3 and channel.results.empty()


def test_rejected_request_fails_only_its_group(tok):
    engine, channel, roller = _scripted_roller(tok, [ValueError("prompt too long"), ([5, 6], [0, 0], "length")])
    failure = run(roller.process_group(make_group(tok, 0, n=1)))
    assert failure.stage == "generate" and "ValueError: prompt too long" in failure.errors[0]
    assert isinstance(run(roller.process_group(make_group(tok, 1, n=1))), GroupResult)


def test_prompt_near_the_context_limit_is_truncated_not_failed(model, tok):
    """A group whose prompt leaves fewer tokens than max_response_length within the engine's context is
    put, its responses cut at the limit with finish_reason=length (it used to fail the group)."""
    room = 2
    groups = [make_group(tok, i) for i in range(2)]
    rollout = RolloutConfig(n=N, max_response_length=8, seed=3)
    results, roller = run(_roll(model, tok, groups, max_seq_len=len(groups[0].input_ids) + room, rollout=rollout,
                                reward_fn=lambda text, truth: 0.0))
    assert roller.drain_failures() == [] and sorted(results) == ["uid0", "uid1"]
    pairs = [(reason, n) for r in results.values()
             for reason, n in zip(r.fields[schema.FINISH_REASON], r.fields[schema.RESPONSE_LENGTH].tolist(),
                                  strict=True)]
    assert all(n <= room for _, n in pairs) and all(n == room for reason, n in pairs if reason == "length")
    assert any(reason == "length" for reason, _ in pairs) and roller.stats()["truncation_ratio"] > 0


def test_engine_error_ends_run_with_that_error(tok):
    engine, channel, roller = _scripted_roller(tok, [EngineError("the engine failed: boom")])
    channel.groups.put_nowait(make_group(tok, 0, n=1))
    with pytest.raises(EngineError, match="boom"):
        run(roller.run())


def test_abort_during_weight_update_records_both_versions(tok):
    """Real TorchEngine: pause(abort) mid-generation, load new weights, resume → the sample continues
    from its prefix under version 1 and records versions 0 and 1."""
    model = spiced_tiny(seed=0)
    new_weights = {k: v.detach().clone() for k, v in spiced_tiny(seed=1).state_dict().items()}

    async def scenario():
        engine = TorchEngine(model, [], max_batch_slots=4)  # no EOS ids beyond the model's own
        channel = LocalGroupChannel()
        group = make_group(tok, 0, n=1)
        rollout = RolloutConfig(n=1, max_response_length=200, temperature=1.0)
        roller = Roller(engine, tok, lambda t, g: 1.0, rollout, channel,
                        poll_timeout_s=0.05)
        roller._stop_ids = ()  # let the sample run long enough to be interrupted
        channel.groups.put_nowait(group)
        task = asyncio.create_task(roller.run(max_groups=1))
        while engine.stats()["num_tokens_generated"] < 5:
            await asyncio.sleep(0.005)
        await engine.pause("abort")
        await engine.load_weights(new_weights.items(), 1)
        await engine.resume()
        await asyncio.wait_for(task, 60)
        await engine.shutdown()
        return channel.results.get_nowait(), roller.stats()

    result, stats = run(scenario())
    fields = result.fields
    if fields[schema.FINISH_REASON] == ["stop"] and fields[schema.MAX_WEIGHT_VERSION].tolist() == [0]:
        pytest.skip("the model emitted EOS before the pause (random weights)")
    assert stats["num_resubmits"] == 1
    assert fields[schema.MIN_WEIGHT_VERSION].tolist() == [0] and fields[schema.MAX_WEIGHT_VERSION].tolist() == [1]
    assert int(fields[schema.RESPONSE_LENGTH][0]) >= 5


# ------------------------------------------------------------------------------------ Ray actor


class RayQueueChannel:
    """A GroupChannel over two ``ray.util.queue.Queue`` actors (a real process boundary for the test)."""

    def __init__(self, groups, results):
        self.groups, self.results = groups, results

    async def take_group(self, timeout_s):
        from ray.util.queue import Empty

        try:
            return await self.groups.get_async(timeout=timeout_s)
        except Empty:
            return None

    async def put_group(self, result):
        await self.results.put_async(result, timeout=30)


def test_ray_actor_rolls_groups_and_reports(ray_cluster, tok):
    from ray.util.queue import Queue

    from rollers.actor import remote_roller

    ray = ray_cluster
    groups_q, results_q = Queue(maxsize=16), Queue(maxsize=16)
    for i in range(2):
        groups_q.put(make_group(tok, i))
    actor = remote_roller(num_cpus=0.1).remote(
        ModelConfig(path="tiny"), RolloutConfig(n=N, max_response_length=4), RollersConfig(num_threads=1,
                                                                                           max_batch_slots=8),
        "tiny_repeat", lambda: RayQueueChannel(groups_q, results_q),
    )
    try:
        ray.get(actor.start.remote(), timeout=60)
        got = [results_q.get(timeout=60) for _ in range(2)]
        assert sorted(r.uid for r in got) == ["uid0", "uid1"]
        assert all(r.fields[schema.RESPONSES].shape[0] == N for r in got)
        stats = ray.get(actor.stats.remote(), timeout=10)
        assert stats["num_groups"] == 2 and stats["tokens_per_s"] > 0
        assert ray.get(actor.drain_failures.remote(), timeout=10) == []
    finally:
        ray.get(actor.shutdown.remote(timeout_s=10), timeout=30)
        ray.kill(actor)
        for q in (groups_q, results_q):
            q.shutdown()


def test_ray_actor_refuses_rollout_top_k_beyond_the_vocabulary(ray_cluster):
    """The torch engine's vocabulary is known once the model is built: the actor fails construction with
    the key named (the controller turns it into a start error), before any request could fail."""
    from rollers.actor import remote_roller

    ray = ray_cluster
    actor = remote_roller(num_cpus=0.1).remote(
        ModelConfig(path="tiny"), RolloutConfig(n=N, top_k=100_000), RollersConfig(num_threads=1), "tiny_repeat",
        LocalGroupChannel)
    try:
        with pytest.raises(ray.exceptions.RayActorError, match="rollout.top_k=100000 exceeds the model's vocabulary"):
            ray.get(actor.stats.remote(), timeout=60)
    finally:
        ray.kill(actor)


# ------------------------------------------------------------------------------------ TransferQueue


@pytest.fixture(scope="module")
def tq_servers():
    from transferqueue.config import TransferQueueConfig
    from transferqueue.launch import start_transferqueue

    servers = start_transferqueue(TransferQueueConfig(num_storage_units=2, capacity_bytes=64 * 1024**2,
                                                      route_block=4, request_timeout_s=20.0))
    yield servers
    servers.shutdown()


def test_roller_loop_against_a_real_transferqueue(tq_servers, model, tok):
    """Feeder puts one prompt row per group (controller.data.prompt_fields) → roller takes each, puts N
    sample rows (the prompt beside each response) and clears the prompt row → a trainer-side
    get_meta(group_complete) sees complete groups with exactly the contract's fields and dtypes."""
    from controller.config import DataConfig
    from controller.data import PromptDataset, prompt_fields
    from rollers.tq_channel import TQGroupChannel
    from transferqueue.client import TQClient

    cfg = DataConfig(task="tiny_repeat", size=3, train_batch_size=3, max_prompt_length=32)
    dataset = PromptDataset.splits(cfg, tok)[0]
    data, tags = prompt_fields(dataset.prompts, tok.pad_token_id, uids=["g0", "g1", "g2"])
    schema.check_batch(schema.FEEDER, data, tags)
    train_fields = list(schema.TRAINER.read_fields())

    async def scenario():
        client = TQClient(tq_servers.handle)
        try:
            meta = await client.aput(data, "step0.prompts", tags=tags)
            engine = TorchEngine(model, tok, max_batch_slots=8)
            channel = TQGroupChannel(client, "step0.prompts", "step0", n=N)
            roller = Roller(engine, tok, tiny_repeat_reward, RolloutConfig(n=N, max_response_length=5), channel,
                            max_groups_in_flight=2, poll_timeout_s=0.2)
            assert await roller.run(max_groups=3) == 3
            await engine.shutdown()
            assert await channel.take_group(0.1) is None  # every group consumed by the rollout task
            own = TQGroupChannel.from_handle(tq_servers.handle.to_dict(), "step0.prompts", "step0", n=N)
            try:  # as a roller builds it
                assert await own.take_group(0.1) is None
            finally:
                own.client.close()
            prompts_left = await client.asample_info("step0.prompts")
            rows = await client.asample_info("step0")
            train = await client.aget_meta(train_fields, 3 * N, "train", "step0",
                                           sampler="group_complete", options={"group_size": N}, timeout_s=10)
            batch = await client.aget_data(train)
            return meta, prompts_left, rows, train, batch
        finally:
            client.close()

    meta, prompts_left, rows, train, batch = run(scenario())
    assert len(meta) == 3 and prompts_left == []  # one prompt row per group, cleared once its samples are put
    # On the wire: exactly the fields the roller declares (no weight-version or length tensors), the tags too.
    roller_fields = set(schema.ROLLER.put_fields())
    assert len(rows) == 3 * N and all(set(r["fields"]) == roller_fields for r in rows)
    assert all(set(r["tags"]) == set(schema.ROLLER.put_tags()) for r in rows)
    assert sorted(train.sample_ids) == sorted(r["id"] for r in rows)
    by_id = dict(zip(train.sample_ids, train.tags, strict=True))
    for tag in by_id.values():
        assert tag[schema.FINISH_REASON] in ("stop", "length")
        assert tag[schema.MIN_WEIGHT_VERSION] == 0 and 1 <= tag[schema.RESPONSE_LENGTH] <= 5
    masks = batch[schema.RESPONSE_MASK]
    for row in range(len(train)):
        assert int(masks[row].sum()) == by_id[train.sample_ids[row]][schema.RESPONSE_LENGTH]
    # Every sample carries its group's prompt row as the feeder put it (padded alike), with declared dtypes.
    prompt_of = {tags[i][schema.UID]: data[schema.INPUT_IDS][i] for i in range(3)}
    for row in range(len(train)):
        assert torch.equal(batch[schema.INPUT_IDS][row], prompt_of[by_id[train.sample_ids[row]][schema.UID]])
    for name in train_fields:  # a field of several widths comes back as a list of rows
        spec = schema.FIELDS[name]
        assert all(str(r.dtype) == f"torch.{spec.dtype}" and r.dim() == len(spec.shape) - 1 for r in batch[name])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(reward=""), "rollout.reward"),
        (dict(reward_timeout_s=0), "rollout.reward_timeout_s"),
        (dict(max_resubmits=-1), "rollout.max_resubmits"),
        (dict(temperature=math.nan), "rollout.temperature"),
        (dict(temperature=math.inf), "rollout.temperature"),
        (dict(top_p=math.nan), "rollout.top_p"),
    ],
)
def test_rollout_config_rejects_bad_reward_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


def test_rollout_top_k_beyond_the_vocabulary_is_refused_naming_the_key():
    RolloutConfig(top_k=100).check_model(vocab_size=100)
    with pytest.raises(ValueError, match=r"rollout.top_k=101 exceeds the model's vocabulary of 100"):
        RolloutConfig(top_k=101).check_model(vocab_size=100)


def test_validation_groups_go_first_to_their_own_partition_with_common_seeds(tq_servers, model, tok):
    """A channel with a validation GroupSource takes a validation group before a training one, decodes its
    last row greedily, puts it back into the validation partition (greedy tag, decoded text), and two rounds
    of one prompt (same seed_key, other uids) sample the same responses."""
    from controller.config import DataConfig
    from controller.data import PromptDataset, prompt_fields
    from rollers.tq_channel import GroupSource, TQGroupChannel
    from transferqueue.client import TQClient

    dataset = PromptDataset.splits(DataConfig(task="tiny_repeat", size=1, train_batch_size=1), tok)[0]
    train_data, train_tags = prompt_fields(dataset.prompts, tok.pad_token_id, uids=["s0.p0"])
    val_data, val_tags = prompt_fields(dataset.prompts * 2, tok.pad_token_id, uids=["v0.p0", "v1.p0"])
    for tag in val_tags:
        tag[schema.SEED_KEY] = "val.p0"

    async def scenario():
        client = TQClient(tq_servers.handle)
        try:
            await client.aput(train_data, "tp", tags=train_tags)
            await client.aput(val_data, "vp", tags=val_tags)
            channel = TQGroupChannel(client, "tp", "t", n=2, validation=GroupSource("vp", "v", 3, num_greedy=1),
                                     put_text=True)
            engine = TorchEngine(model, tok, max_batch_slots=8)
            roller = Roller(engine, tok, tiny_repeat_reward, RolloutConfig(n=2, max_response_length=4), channel)
            groups = [await channel.take_group(1.0) for _ in range(3)]
            for group in groups:
                await roller.process_group(group)
            await engine.shutdown()
            val = await client.aget_meta([schema.RESPONSES, schema.RESPONSE_TEXT], 6, "validate", "v", timeout_s=10)
            return groups, val, await client.aget_data(val), await client.asample_info("vp")
        finally:
            client.close()

    groups, val, batch, val_prompts_left = run(scenario())
    assert val_prompts_left == []  # the validation prompt rows are cleared from their own partition
    assert [(g.uid, g.validation, g.num_greedy, g.seed_key) for g in groups] == [
        ("v0.p0", True, 1, "val.p0"), ("v1.p0", True, 1, "val.p0"), ("s0.p0", False, 0, "")]
    tags = sorted(val.tags, key=lambda t: t[schema.UID])
    assert [t[schema.GREEDY] for t in tags] == [0, 0, 1, 0, 0, 1]
    by_round = [[t[schema.RESPONSE_DIGEST] for t in tags if t[schema.UID] == uid] for uid in ("v0.p0", "v1.p0")]
    assert by_round[0] == by_round[1]  # common random numbers: same seeds, same weights, same responses
    assert all(isinstance(text, str) for text in batch[schema.RESPONSE_TEXT])
