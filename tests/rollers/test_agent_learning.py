"""The tiny model learns to call a tool when calling it is the only way to the reward: the agent loop's
trajectories, the trainer's GRPO advantages and PPO loss (``response_mask`` with tool tokens masked out),
in one process, the engine sharing the policy's parameters."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import schema
from common.models import ModelConfig, load_model, load_tokenizer
from rollers.config import RolloutConfig
from rollers.roller import GroupResult, Roller
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import LocalGroupChannel, run
from tests.rollers.test_agent_loop import ENV, make_group, short_turn_stops
from trainers.advantages import compute_advantages
from trainers.fsdp import response_log_probs
from trainers.losses import policy_loss

NUM_GROUPS, N, STEPS = 4, 8, 30  # measured: the share of tool calls goes 0.03 -> 1.0 by step ~21


def _called(fields) -> float:
    """Share of trajectories with a tool observation (an environment span) inside their response."""
    mask, lengths = fields[schema.RESPONSE_MASK], fields[schema.RESPONSE_LENGTH]
    return sum(0 in mask[r, : int(lengths[r])].tolist() for r in range(len(lengths))) / len(lengths)


@pytest.mark.slow  # ~60 s of CPU: 30 rollout + update steps
@pytest.mark.timeout(600)
def test_tiny_model_learns_to_call_the_tool():
    torch.manual_seed(0)
    tok = load_tokenizer(ModelConfig(path="tiny"))
    model = load_model(ModelConfig(path="tiny"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rollout = RolloutConfig(n=N, max_response_length=16, max_turns=2, environment=ENV + "tool_only_reward")

    async def train() -> list[float]:
        engine = TorchEngine(model, tok, max_batch_slots=NUM_GROUPS * N)
        roller = Roller(engine, tok, lambda text, gt: 0.0, rollout, LocalGroupChannel(), poll_timeout_s=0.05)
        roller.agent.stop_ids = short_turn_stops(tok)
        called = []
        try:
            for step in range(STEPS):
                groups = [make_group(tok, step * NUM_GROUPS + i, n=N) for i in range(NUM_GROUPS)]
                results = await asyncio.gather(*(roller.process_group(g) for g in groups))
                assert all(isinstance(r, GroupResult) for r in results)
                called.append(sum(_called(r.fields) for r in results) / NUM_GROUPS)
                _update(model, optimizer, groups, results, rollout.max_response_length)
        finally:
            await engine.shutdown()
        return called

    called = run(train(), timeout_s=560)  # generous: a loaded 2-core machine is 5x slower
    print("tool-call share per step:", [round(c, 2) for c in called])
    first, last = sum(called[:3]) / 3, sum(called[-3:]) / 3
    assert first < 0.5, called
    assert last > 0.85, called


def _update(model, optimizer, groups, results, width: int) -> None:
    """One GRPO step (Shao et al. 2024) on the groups' trajectories: advantages by uid, PPO loss at ratio 1."""
    fields = {k: torch.cat([_pad(r.fields[k], width) for r in results]) for k in
              (schema.RESPONSES, schema.RESPONSE_MASK, schema.ROLLOUT_LOG_PROBS, schema.TOKEN_LEVEL_SCORES)}
    prompts = torch.tensor([g.input_ids for g in groups for _ in range(N)])
    uid = [g.uid for g in groups for _ in range(N)]
    mask = fields[schema.RESPONSE_MASK]
    advantages, _ = compute_advantages("grpo", token_level_rewards=fields[schema.TOKEN_LEVEL_SCORES],
                                       response_mask=mask, uid=uid)
    model.train()
    batch = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts), "responses": fields[schema.RESPONSES]}
    log_probs, _ = response_log_probs(model, batch, temperature=1.0)
    loss, _ = policy_loss(log_probs, fields[schema.ROLLOUT_LOG_PROBS], advantages, mask)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))
