"""The agent loop against a real SGLang server (``gpu``; skipped without CUDA or without SGLang installed).

The server is ``tests.rollers.test_sglang_api.launch_served("sglang")``: SmolLM2-135M-Instruct, driven over
``/generate`` with ``input_ids``. What the CPU suite checks against our torch server behind the same API
(``test_sglang_api.test_agent_loop_drives_the_server_with_input_ids``), checked here with SGLang's own
scheduler, sampler and pause/continue: observations tokenised with the real ChatML template, log-probs only on
model tokens, forced turn lengths, and a trajectory paused mid-turn by a weight update that resumes and records
both versions.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import schema
from common.models import apply_chat_template, load_tokenizer
from rollers.agent_loop import ObservationFormatter
from rollers.config import RolloutConfig
from rollers.response_fields import forced_response_length
from rollers.rewards import tiny_repeat_reward
from rollers.roller import GroupResult, PromptGroup, Roller
from tests.rollers import agent_envs
from tests.rollers.engine_helpers import LocalGroupChannel, run
from tests.rollers.test_agent_loop import ENV, _spans
from tests.rollers.test_sglang_api import _perturbed, _push, connected, launch_served

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sglang_server(request):
    return launch_served(request, "sglang")


def _group(tok, uid: str, n: int) -> PromptGroup:
    ids = tuple(apply_chat_template(tok, "Say one short sentence."))
    return PromptGroup(uid, 0, n, ids, {"answer": "a"})


async def _roll(url: str, tok, rollout: RolloutConfig, group: PromptGroup, during=None):
    """``group`` through a Roller whose engine is the SGLang client; ``during(client)`` runs meanwhile."""
    async with connected(url) as client:
        roller = Roller(client, tok, tiny_repeat_reward, rollout, LocalGroupChannel(), poll_timeout_s=0.05)
        task = asyncio.create_task(roller.process_group(group))
        if during is not None:
            await during(client)
        return await task, roller.stats()


def test_trajectories_over_sglang_mask_observations_in_the_chat_template(sglang_server):
    tok = load_tokenizer(sglang_server.model)
    rollout = RolloutConfig(n=2, max_response_length=160, seed=3, environment=ENV + "scripted_turns",
                            forced_response_lengths=[[1, 6, 12]])
    group = _group(tok, "gpu0", 2)
    result, stats = run(_roll(sglang_server.url, tok, rollout, group))
    assert isinstance(result, GroupResult) and stats["num_turns"] == 2 * (agent_envs.SCRIPT_TURNS + 1)
    observation = ObservationFormatter(tok).tokens("user", agent_envs.SCRIPT_OBSERVATION)
    fields = result.fields
    for i in range(2):
        length = int(fields[schema.RESPONSE_LENGTH][i])
        mask = fields[schema.RESPONSE_MASK][i, :length].tolist()
        spans = _spans(mask)
        model_turns = [end - start for v, start, end in spans if v == 1]
        assert model_turns == [forced_response_length(rollout, f"gpu0/turn{k}", i)
                               for k in range(agent_envs.SCRIPT_TURNS + 1)]
        for v, start, end in spans:
            if v == 0:
                assert fields[schema.RESPONSES][i, start:end].tolist() == observation
        log_probs = fields[schema.ROLLOUT_LOG_PROBS][i, :length]
        as_mask = torch.tensor(mask)
        assert torch.all(log_probs[as_mask == 0] == 0) and torch.all(log_probs[as_mask == 1] < 0)


def test_trajectory_paused_mid_turn_by_a_weight_update_over_sglang_resumes(sglang_server):
    """Long forced turns are in flight when new weights arrive (pause mode ``abort``): each aborted turn is
    resubmitted with its prefix, and the trajectories' model tokens span the old and the new version."""
    tok = load_tokenizer(sglang_server.model)
    rollout = RolloutConfig(n=2, max_response_length=1200, seed=4, environment=ENV + "scripted_turns",
                            forced_response_lengths=[[1, 300, 300]])
    weights = _perturbed(sglang_server.model, seed=404)
    pushed = []

    async def update(client):
        await asyncio.sleep(0.5)  # the first turns are decoding (300 tokens each)
        pushed.append(await _push(client, weights, mode="abort"))

    result, stats = run(_roll(sglang_server.url, tok, rollout, _group(tok, "gpu1", 2), update))
    assert isinstance(result, GroupResult) and stats["num_turn_resubmits"] >= 1
    fields = result.fields
    assert fields[schema.MAX_WEIGHT_VERSION].tolist() == [pushed[0]] * 2
    assert all(v < pushed[0] for v in fields[schema.MIN_WEIGHT_VERSION].tolist())
    for i in range(2):  # every turn got its full forced length across the pause
        mask = fields[schema.RESPONSE_MASK][i, : int(fields[schema.RESPONSE_LENGTH][i])].tolist()
        assert [end - start for v, start, end in _spans(mask) if v == 1] == [300] * (agent_envs.SCRIPT_TURNS + 1)
