"""The agent loop (multi-turn trajectories): masks, log-probs, versions, budget, failures, partial rollout."""

from __future__ import annotations

import asyncio
import logging
import math
import re

import pytest
import torch

from common import schema
from common.models import ModelConfig, apply_chat_template, load_tokenizer
from rollers.agent_loop import ObservationFormatter, _describe_call, environment_seed
from rollers.config import RolloutConfig
from rollers.environments import EnvironmentSpec
from rollers.response_fields import forced_response_length
from rollers.rewards import tiny_repeat_reward
from rollers.roller import FailedGroup, GroupResult, PromptGroup, Roller
from rollers.torch_engine import TorchEngine
from tests.rollers import agent_envs
from tests.rollers.agent_envs import SCRIPT_TURNS, TURN_REWARD
from tests.rollers.engine_helpers import LocalGroupChannel, run, spiced_tiny
from tests.rollers.test_roller import ScriptedEngine

N = 4
ENV = "tests.rollers.agent_envs:"
_BUILT_IN = ("calculator", "gem")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="module")
def model():
    return spiced_tiny(seed=2)


def make_group(tok, i: int, n: int = N) -> PromptGroup:
    symbol = "abcdefgh"[i % 8]
    ids = tuple(apply_chat_template(tok, f"repeat the word {symbol}"))
    return PromptGroup(f"uid{i}", i, n, ids, {"answer": symbol})


def short_turn_stops(tok) -> tuple[int, ...]:
    """EOS plus frequent words: the random tiny model then ends its turns after a few tokens."""
    return (tok.eos_token_id, *tok.convert_tokens_to_ids(["is", ".", "the", "word", "a", "b", "c"]))


async def _roll(model, tok, groups, environment, engine=None, **rollout_kwargs):
    """Roll ``groups`` through a Roller; ``environment``: a name in ``agent_envs``, or ``module:name`` /
    a built-in name when it contains no test-env name (``gem``)."""
    rollout_kwargs = {"n": N, "max_response_length": 64, "seed": 5, **rollout_kwargs}
    spec = environment if environment in _BUILT_IN else ENV + environment
    rollout = RolloutConfig(environment=spec, **rollout_kwargs)
    engine = engine or TorchEngine(model, tok, max_batch_slots=16)
    channel = LocalGroupChannel()
    for group in groups:
        channel.groups.put_nowait(group)
    roller = Roller(engine, tok, tiny_repeat_reward, rollout, channel, poll_timeout_s=0.05)
    roller.agent.stop_ids = short_turn_stops(tok)
    try:
        await roller.run(max_groups=len(groups))
    finally:
        await engine.shutdown()
    results = []
    while not channel.results.empty():
        results.append(channel.results.get_nowait())
    return results, roller


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of ``mask``."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_trajectory_masks_log_probs_scores_and_versions(model, tok):
    groups = [make_group(tok, 0)]
    results, roller = run(_roll(model, tok, groups, "scripted_turns"))
    assert len(results) == 1 and roller.drain_failures() == []
    observation = ObservationFormatter(tok).tokens("user", agent_envs.SCRIPT_OBSERVATION)
    num_multi_turn = 0
    for result, group in zip(sorted(results, key=lambda r: r.uid), groups, strict=True):
        f = result.fields
        for row in range(N):
            length = int(f[schema.RESPONSE_LENGTH][row])
            ids = f[schema.RESPONSES][row, :length].tolist()
            mask = f[schema.RESPONSE_MASK][row, :length].tolist()
            assert f[schema.RESPONSE_MASK][row, length:].sum() == 0
            model_runs = [(s, e) for v, s, e in _spans(mask) if v == 1]
            env_runs = [(s, e) for v, s, e in _spans(mask) if v == 0]
            assert mask[0] == 1 and mask[-1] == 1  # a trajectory starts and ends with the model
            for s, e in env_runs:  # every environment span is exactly the formatted observation
                assert ids[s:e] == observation
            log_probs = f[schema.ROLLOUT_LOG_PROBS][row, :length]
            assert torch.all(log_probs[torch.tensor(mask) == 0] == 0)
            assert torch.all(log_probs[torch.tensor(mask) == 1] < 0)
            # token-in/token-out: the model's tokens have the log-probs the model gives them in this context
            with torch.no_grad():
                full = torch.tensor([list(group.input_ids) + ids])
                logits = model(full).logits[0, len(group.input_ids) - 1:-1].float()
                recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            on = torch.tensor(mask) == 1
            torch.testing.assert_close(log_probs[on], recomputed[on], atol=2e-4, rtol=0)
            scores = f[schema.TOKEN_LEVEL_SCORES][row, :length]
            for _, e in model_runs[:-1]:  # each answered turn's reward sits on its last token
                assert scores[e - 1] == pytest.approx(agent_envs.TURN_REWARD)
            assert float(scores.sum()) == pytest.approx(result.rewards[row])
            assert set(torch.nonzero(scores).flatten().tolist()) <= {e - 1 for _, e in model_runs}
            num_multi_turn += len(model_runs) > 1
        assert f[schema.MIN_WEIGHT_VERSION].tolist() == [0] * N
    assert num_multi_turn >= 2  # the stop words make most trajectories multi-turn
    assert roller.stats()["turns_per_trajectory"] > 1


def test_max_turns_and_length_budget_end_the_trajectory(model, tok):
    results, roller = run(_roll(model, tok, [make_group(tok, 0)], "scripted_turns", max_turns=1))
    f = results[0].fields
    assert f[schema.RESPONSE_MASK].bool().logical_or(f[schema.RESPONSES] == tok.pad_token_id).all()
    assert roller.stats()["turns_per_trajectory"] == 1.0
    results, _ = run(_roll(model, tok, [make_group(tok, 1)], "scripted_turns", max_response_length=12))
    f = results[0].fields
    assert int(f[schema.RESPONSE_LENGTH].max()) <= 12 and f[schema.RESPONSES].shape[1] <= 12


@pytest.mark.parametrize("environment, timeout_s, error", [
    ("raising", 30.0, "the environment broke"), ("hanging", 0.2, "rollout.env_timeout_s=0.2"),
    ("nan_reward", 30.0, "reward returned nan"), ("none_factory", 30.0, "returned NoneType, not an Environment"),
    ("sync_hanging", 0.2, "rollout.env_timeout_s=0.2"), ("done_str", 30.0, "StepResult.done='False', not a bool")])
def test_failing_environment_fails_its_group_never_the_roller(model, tok, environment, timeout_s, error):
    results, roller = run(_roll(model, tok, [make_group(tok, i, n=2) for i in range(2)], environment,
                                n=2, env_timeout_s=timeout_s))
    assert results == []  # run() returned: the roller survived both groups
    failures = roller.drain_failures()
    assert [f.stage for f in failures] == ["environment", "environment"]
    assert all(isinstance(f, FailedGroup) for f in failures) and error in failures[0].errors[0]
    assert roller.stats()["num_failed_rewards"] == 2 * 2


def test_a_failed_step_is_named_in_its_error(model, tok):
    """A timed-out call names the environment, the method and the start of its argument (the model's turn:
    a tool call shows which tool hung)."""
    results, roller = run(_roll(model, tok, [make_group(tok, 0, n=1)], "hanging", n=1, env_timeout_s=0.2))
    error = roller.drain_failures()[0].errors[0]
    assert re.search(r"environment '[\w.:]*hanging'\.step\('", error) and "env_timeout_s=0.2" in error


def test_a_failed_calls_description_shows_the_tool_and_survives_any_argument():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>' + " on" * 50
    described = _describe_call("calc", agent_envs.ScriptedTurns.step, (call,))
    assert described.startswith("environment 'calc'.step('<tool_call>{\"name\": \"calculator\"")
    assert len(described) < 150
    huge = _describe_call("calc", agent_envs.ScriptedTurns.reset, ({"answer": 10**5000},))  # repr: ValueError
    assert huge == "environment 'calc'.reset(dict)"


@pytest.mark.parametrize("environment, timeout_s", [("close_raising", 30.0), ("close_hanging", 0.2)])
def test_a_failing_close_keeps_its_scored_trajectory(model, tok, environment, timeout_s, caplog):
    """Counted every time, warned the 1st (10th, 100th...) time, and the trajectories keep their scores."""
    groups = [make_group(tok, 0, n=2)]
    with caplog.at_level(logging.WARNING, logger="rollers.agent_loop"):
        results, roller = run(_roll(model, tok, groups, environment, n=2, env_timeout_s=timeout_s))
    assert roller.drain_failures() == [] and len(results) == 1 and isinstance(results[0], GroupResult)
    assert all(math.isfinite(r) for r in results[0].rewards) and roller.stats()["num_env_close_failures"] == 2
    assert caplog.text.count("close failures in this roller") == 1 and ".close()" in caplog.text


def test_sync_environment_methods_run_in_threads_of_their_own(model, tok):
    results, roller = run(_roll(model, tok, [make_group(tok, 0, n=2)], "sync_turns", n=2))
    assert roller.drain_failures() == [] and len(results) == 1
    # every step was answered by the sync methods: k answered turns, then (if the budget allowed) the score
    possible = {k * TURN_REWARD + done for k in range(1, SCRIPT_TURNS + 1) for done in (0.0, 1.0)}
    assert all(min(abs(r - p) for p in possible) < 1e-6 for r in results[0].rewards)


def test_numpy_step_rewards_count_as_in_single_turn(model, tok):
    """A step's reward follows the rule of reward functions (``rewards.reward_result``): a numpy scalar is a
    number, as it is for a single-turn reward."""
    results, roller = run(_roll(model, tok, [make_group(tok, 0, n=2)], "numpy_reward", n=2))
    assert roller.drain_failures() == [] and results[0].rewards == [agent_envs.NUMPY_REWARD] * 2


def test_turn_aborted_mid_generation_resumes_with_its_prefix(tok):
    """A weight update aborts a turn: the turn is resubmitted with prompt + trajectory so far, and the
    trajectory records both versions."""
    eos = tok.eos_token_id
    engine = ScriptedEngine([([10, 11], [0, 0], "abort"), ([12, eos], [1, 1], "stop"),  # turn 1, across v0 → v1
                             ([13, eos], [1, 1], "stop"), ([14, eos], [1, 1], "stop")])  # turns 2 and 3
    channel = LocalGroupChannel()
    rollout = RolloutConfig(n=1, max_response_length=64, environment=ENV + "scripted_turns")
    roller = Roller(engine, tok, lambda text, gt: 1.0, rollout, channel, poll_timeout_s=0.05)
    group = make_group(tok, 0, n=1)
    result = run(roller.process_group(group))
    assert isinstance(result, GroupResult)
    obs = ObservationFormatter(tok).tokens("user", agent_envs.SCRIPT_OBSERVATION)
    assert engine.requests[1].input_ids == group.input_ids + (10, 11)
    assert engine.requests[2].input_ids == group.input_ids + (10, 11, 12, eos, *obs)
    f = result.fields
    assert f[schema.RESPONSES][0].tolist() == [10, 11, 12, eos, *obs, 13, eos, *obs, 14, eos]
    assert f[schema.MIN_WEIGHT_VERSION].tolist() == [0] and f[schema.MAX_WEIGHT_VERSION].tolist() == [1]
    assert result.rewards == [pytest.approx(2 * agent_envs.TURN_REWARD + 1.0)]
    assert roller.stats()["num_turn_resubmits"] == 1


def test_trajectory_paused_while_waiting_on_its_tool_records_both_versions(tok):
    """Real TorchEngine: the trajectory waits in ``env.step`` while the weights change (pause, load v1,
    resume); its first turn is version 0, its second version 1."""
    model = spiced_tiny(seed=0)
    new_weights = {k: v.detach().clone() for k, v in spiced_tiny(seed=1).state_dict().items()}

    async def scenario():
        gate = agent_envs.GATE["gate"] = asyncio.Event()
        engine = TorchEngine(model, tok, max_batch_slots=2)
        channel = LocalGroupChannel()
        rollout = RolloutConfig(n=1, max_response_length=48, environment=ENV + "gated")
        roller = Roller(engine, tok, tiny_repeat_reward, rollout, channel, poll_timeout_s=0.05)
        roller.agent.stop_ids = short_turn_stops(tok)
        task = asyncio.create_task(roller.process_group(make_group(tok, 0, n=1)))
        while roller.stats()["requests_in_flight"] > 0 or engine.stats()["num_tokens_generated"] == 0:
            await asyncio.sleep(0.005)  # the first turn is done: the trajectory waits on its environment
        await engine.pause("abort")
        await engine.load_weights(new_weights.items(), 1)
        await engine.resume()
        gate.set()
        result = await asyncio.wait_for(task, 60)
        await engine.shutdown()
        return result

    result = run(scenario())
    assert isinstance(result, GroupResult)
    f = result.fields
    mask = f[schema.RESPONSE_MASK][0].tolist()
    assert [v for v, _, _ in _spans(mask[: int(f[schema.RESPONSE_LENGTH][0])])] == [1, 0, 1]
    assert f[schema.MIN_WEIGHT_VERSION].tolist() == [0] and f[schema.MAX_WEIGHT_VERSION].tolist() == [1]


def test_environment_config_is_checked():
    with pytest.raises(ValueError, match="rollout.environment"):
        RolloutConfig(environment="no_such_env")
    with pytest.raises(ValueError, match="rollout.max_turns"):
        RolloutConfig(max_turns=0)
    with pytest.raises(ValueError, match="rollout.env_timeout_s"):
        RolloutConfig(env_timeout_s=0)
    with pytest.raises(ValueError, match=r"rollout.env_kwargs.depth: environment 'calculator' has no such option"):
        RolloutConfig(environment="calculator", env_kwargs={"depth": 1})
    with pytest.raises(ValueError, match="set rollout.environment"):
        RolloutConfig(env_kwargs={"turns": 2})
    spec = EnvironmentSpec("x", lambda ctx: None, {"turns": 2, "latency_s": 0.5, "name": "a"})
    assert spec.resolve_options({"latency_s": 1}) == {"turns": 2, "latency_s": 1, "name": "a"}
    for bad in ({"turns": "2"}, {"turns": True}, {"name": 3}):
        with pytest.raises(ValueError, match=f"rollout.env_kwargs.{next(iter(bad))}="):
            spec.resolve_options(bad)


def test_forced_turn_lengths_and_the_environment_seed_are_per_sample(model, tok):
    """With rollout.forced_response_lengths each model turn decodes its own drawn length (EOS ignored, per uid,
    sample index and turn), and each trajectory's environment gets environment_seed(rollout.seed, uid, index)."""
    agent_envs.SEEDS.clear()
    results, roller = run(_roll(model, tok, [make_group(tok, 0)], "scripted_turns", max_response_length=96,
                                forced_response_lengths=[[1, 2, 9]]))
    assert roller.drain_failures() == [] and len(results) == 1
    rollout = RolloutConfig(n=N, seed=5, forced_response_lengths=[[1, 2, 9]], max_response_length=96)
    lengths = []
    for i in range(N):
        mask = results[0].fields[schema.RESPONSE_MASK][i].tolist()
        model_spans = [end - start for v, start, end in _spans(mask) if v == 1]
        expected = [forced_response_length(rollout, f"uid0/turn{k}", i) for k in range(agent_envs.SCRIPT_TURNS + 1)]
        assert model_spans == expected
        lengths += expected
    assert len(set(lengths)) > 1  # the draws differ, so the check above pins which draw each turn got
    assert sorted(agent_envs.SEEDS) == sorted(environment_seed(5, "uid0", i) for i in range(N))


def test_observation_formatter_follows_the_chat_template(tok):
    ids = ObservationFormatter(tok).tokens("user", "say the word a")
    assert tok.convert_ids_to_tokens(ids) == ["user", ":", "say", "the", "word", "a", "</s>", "assistant", ":"]



def test_calculator_preset_loads_a_multi_turn_config():
    from controller.config import load_config

    cfg = load_config(preset="smollm2-calculator")
    assert cfg.rollout.environment == "calculator" and cfg.rollout.max_turns == 3
    assert "<tool_call>" in cfg.data.system_prompt
