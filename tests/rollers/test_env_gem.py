"""The ``gem`` environment adapter (``rollers.env_adapters.gem``): real GEM games through the agent loop.

Needs ``gem-llm`` (the optional extra ``hflow-async[gem]``; the Makefile installs it for CI); skipped without it.
"""

from __future__ import annotations

import re

import pytest

from common.models import ModelConfig, load_tokenizer
from rollers.agent_loop import AgentLoop, ObservationFormatter, environment_seed
from rollers.config import RolloutConfig
from rollers.rewards import tiny_repeat_reward
from rollers.roller import PromptGroup
from tests.rollers.engine_helpers import run
from tests.rollers.test_agent_loop import _roll, _spans, make_group, model, tok  # noqa: F401 - fixtures
from tests.rollers.test_roller import ScriptedEngine

gem = pytest.importorskip("gem")
from gem.utils.constants import LanguageGameReward  # noqa: E402

GUESS = "game:GuessTheNumber-v0-easy"
SEED = 5


def _game(uid: str, index: int):
    """The GEM game the adapter builds for sample ``index`` of ``uid`` (rollout.seed=SEED): (instructions, target)."""
    env = gem.make(GUESS)
    instructions, _ = env.reset(seed=environment_seed(SEED, uid, index) % 2**32)
    return instructions, env.game_number


def test_gem_game_through_the_agent_loop_with_the_tiny_model(model, tok):  # noqa: F811
    """The game's instructions are the first observation (mask 0, exactly the template's tokens of GEM's text
    for this sample's seed); the tiny model's turn has no \\boxed{} guess, so GEM ends the game with its
    format-error reward, which lands on the turn's last token."""
    results, roller = run(_roll(model, tok, [make_group(tok, 0)], "gem", env_kwargs={"env_id": GUESS}, max_response_length=160,
                                max_turns=3))
    assert roller.drain_failures() == [] and len(results) == 1
    fields = results[0].fields
    formatter = ObservationFormatter(tok)
    for i in range(4):
        mask = fields["response_mask"][i].tolist()
        spans = _spans(mask)
        assert spans[0][0] == 0 and spans[1][0] == 1, spans  # observation, then the model's turn
        first = fields["responses"][i, : spans[0][2]].tolist()
        assert first == formatter.tokens("user", _game("uid0", i)[0])
        end = spans[1][2]
        scores = fields["token_level_scores"][i]
        assert scores[end - 1].item() == pytest.approx(LanguageGameReward.format_error_reward)
        assert results[0].rewards[i] == pytest.approx(LanguageGameReward.format_error_reward)


def test_gem_game_over_several_turns_rewards_the_winning_guess():
    """A scripted player (SmolLM2's tokenizer) guesses wrong, then right: two turns, GEM's hint between them
    as an observation, 0 on the first turn and GEM's success reward on the winning one."""
    stok = load_tokenizer(ModelConfig(path="smollm2-135m-instruct"))
    instructions, target = _game("g0", 0)
    wrong = 1 if target != 1 else 2
    script = [(stok.encode(f"\\boxed{{{g}}}", add_special_tokens=False) + [stok.eos_token_id], None, "stop")
              for g in (wrong, target)]
    script = [(ids, [0] * len(ids), reason) for ids, _, reason in script]
    engine = ScriptedEngine(script)
    rollout = RolloutConfig(n=1, max_response_length=400, seed=SEED, environment="gem",
                            env_kwargs={"env_id": GUESS}, max_turns=4)
    loop = AgentLoop(rollout, stok, tiny_repeat_reward, (stok.eos_token_id,))
    group = PromptGroup("g0", 0, 1, tuple(stok.encode("Play.")), {"answer": ""})

    async def generate(request):
        return await engine.generate(request)

    traj = run(loop.run(group, 0, False, generate, "g0/0", None))
    assert traj.error == "" and traj.num_turns == 2 and traj.finish_reason == "stop"
    spans = _spans(traj.response_mask)
    assert [s[0] for s in spans] == [0, 1, 0, 1]
    hint = stok.decode(traj.output_ids[spans[2][1]:spans[2][2]])
    assert re.search(rf"you guessed {wrong}, and the target number is (higher|lower)", hint), hint
    assert traj.token_scores[spans[1][2] - 1] == 0.0
    assert traj.token_scores[spans[3][2] - 1] == pytest.approx(LanguageGameReward.success_reward)
    assert traj.reward == pytest.approx(LanguageGameReward.success_reward)
    assert instructions in stok.decode(traj.output_ids[: spans[0][2]])


def test_importing_gem_leaves_the_process_logging_as_it_was(monkeypatch):
    """gem-llm's import calls logging.basicConfig(level=INFO); the adapter undoes it (imported afresh here)."""
    import logging
    import sys

    from rollers.env_adapters import gem as adapter

    for name in [m for m in sys.modules if m == "gem" or m.startswith("gem.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)
    fresh = adapter._import_gem()
    assert fresh is not gem and root.handlers == [] and root.level == logging.WARNING


def test_gem_options_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match=r"rollout.env_kwargs.env_id='game:NoSuchGame'"):
        RolloutConfig(environment="gem", env_kwargs={"env_id": "game:NoSuchGame"})
    with pytest.raises(ValueError, match=r"rollout.env_kwargs.seed: environment 'gem' has no such option"):
        RolloutConfig(environment="gem", env_kwargs={"seed": 1})
    with pytest.raises(ValueError, match=r"rollout.env_kwargs.observation_role"):
        RolloutConfig(environment="gem", env_kwargs={"observation_role": "assistant"})
