"""Multi-turn samples: ``response_mask`` with interior zeros (environment/tool tokens inside the response).

The trainer's losses, KL and advantages must use the model's tokens only; tool tokens count only as context.
Float64 tiny model, small well-conditioned values (the loss gradient at ratio 1)."""

from __future__ import annotations

import pytest
import torch

from common.models import ModelConfig, load_model
from tests.trainers._trainer_batches import float64_random
from trainers.advantages import compute_advantages
from trainers.fsdp import response_log_probs
from trainers.kl import apply_kl_in_reward, kl_loss
from trainers.losses import LOSS_AGG_MODES, policy_loss

PROMPT_LEN, RESP_LEN = 5, 14
# Two samples: model turn, tool tokens (mask 0), model turn, then padding on the second.
MASK = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1],
                     [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]])


@pytest.fixture(scope="module")
def model():
    return float64_random(load_model(ModelConfig(path="tiny")))


def _batch(seed: int, tool_seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(4, 40, (2, RESP_LEN), generator=gen)
    tool = torch.randint(4, 40, (2, RESP_LEN), generator=torch.Generator().manual_seed(tool_seed))
    responses = torch.where(MASK.bool(), responses, tool)  # tool-token content depends on tool_seed only
    return {"input_ids": torch.randint(4, 40, (2, PROMPT_LEN), generator=gen),
            "attention_mask": torch.ones(2, PROMPT_LEN, dtype=torch.int64), "responses": responses}


def _side_inputs(seed: int, garbage_seed: int | None) -> dict[str, torch.Tensor]:
    """Advantages and reference log-probs on model tokens; anything (large, NaN-free) on tool tokens."""
    gen = torch.Generator().manual_seed(seed)
    values = {"advantages": torch.randn(2, RESP_LEN, generator=gen, dtype=torch.float64),
              "ref": 0.3 * torch.randn(2, RESP_LEN, generator=gen, dtype=torch.float64) - 3.7,
              "rollout": 0.3 * torch.randn(2, RESP_LEN, generator=gen, dtype=torch.float64) - 3.7}
    if garbage_seed is not None:
        junk = torch.Generator().manual_seed(garbage_seed)
        for key, value in values.items():
            values[key] = torch.where(MASK.bool(), value, 1e3 * torch.randn(2, RESP_LEN, generator=junk,
                                                                           dtype=torch.float64))
    return values


def _grad(model, batch, side, agg: str) -> torch.Tensor:
    model.zero_grad()
    log_probs, _ = response_log_probs(model, batch, temperature=1.0)
    old = log_probs.detach()
    pg, _ = policy_loss(log_probs, old, side["advantages"], MASK, loss_agg_mode=agg, norm_length=RESP_LEN,
                        rollout_log_probs=side["rollout"], stale_correction="tis")
    kl, _ = kl_loss(log_probs, side["ref"], MASK, estimator="k2", loss_agg_mode=agg, norm_length=RESP_LEN)
    (pg + 0.1 * kl).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("agg", LOSS_AGG_MODES.names())
def test_values_on_tool_tokens_change_no_gradient(model, agg):
    batch = _batch(0, tool_seed=1)
    clean = _grad(model, batch, _side_inputs(2, None), agg)
    garbled = _grad(model, batch, _side_inputs(2, garbage_seed=3), agg)
    assert clean.abs().max() > 0
    torch.testing.assert_close(garbled, clean, rtol=1e-12, atol=1e-14)


def _per_position_log_probs(model, batch) -> torch.Tensor:
    """log p(token t | prompt + responses[:t]) by one forward per position (no padding, nothing after t)."""
    out = torch.zeros(2, RESP_LEN, dtype=torch.float64)
    for row in range(2):
        for t in range(RESP_LEN):
            if MASK[row, t]:
                context = torch.cat([batch["input_ids"][row], batch["responses"][row, :t]])[None]
                logits = model(input_ids=context, use_cache=False).logits[0, -1]
                out[row, t] = torch.log_softmax(logits, -1)[batch["responses"][row, t]]
    return out


def _reference_grad(model, batch, side) -> torch.Tensor:
    """The gradient of the model tokens' own loss (vanilla PPO at ratio 1 with TIS weights, k2 KL, token-mean),
    each token's log-prob from its own context."""
    model.zero_grad()
    log_probs = _per_position_log_probs(model, batch)
    num_tokens, on = MASK.sum(), MASK.bool()
    weight = torch.exp(log_probs.detach() - side["rollout"]).clamp(max=2.0)[on]  # tis weight (tis_cap 2)
    pg = -(side["advantages"][on] * weight * torch.exp(log_probs[on] - log_probs[on].detach())).sum() / num_tokens
    kl = 0.5 * ((log_probs[on] - side["ref"][on]) ** 2).sum() / num_tokens  # k2 (no clamps)
    (pg + 0.1 * kl).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_tool_tokens_enter_the_gradient_only_as_context(model):
    """Whatever the tool tokens are, the trainer's gradient is that of the model tokens' own loss, each
    token's log-prob computed from its context alone: tool tokens change the gradient only through it."""
    side = _side_inputs(2, None)
    references = []
    for tool_seed in (1, 7):
        batch = _batch(0, tool_seed)
        references.append(_reference_grad(model, batch, side))
        # the trainer takes log-softmax in fp32 (trainers.fsdp.response_log_probs): fp32-level agreement
        torch.testing.assert_close(_grad(model, batch, side, "token-mean"), references[-1], rtol=1e-4, atol=1e-6)
    assert (references[0] - references[1]).abs().max() > 1e-3  # the context did change


def test_advantages_skip_tool_tokens():
    """Outcome estimators put the sample's advantage on model tokens only; GAE and REINFORCE++ on a
    trajectory equal the same estimator on its model tokens alone (tool tokens are skipped, not steps)."""
    rewards = torch.zeros(2, RESP_LEN, dtype=torch.float64)
    rewards[0, 2], rewards[0, 13], rewards[1, 7] = 0.5, 1.0, -1.0  # per-turn rewards on turns' last tokens
    uid = ["g", "g"]
    adv, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=MASK, uid=uid)
    assert torch.all(adv[~MASK.bool()] == 0) and torch.all(adv[MASK.bool()] != 0)
    values = torch.randn(2, RESP_LEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for name, extra in (("gae", {"values": values}), ("reinforce_plus_plus", {})):
        full, full_ret = compute_advantages(name, token_level_rewards=rewards, response_mask=MASK, gamma=0.9,
                                            lam=0.8, norm_adv_by_std=False, **extra)
        for row in range(2):
            on = MASK[row].bool()
            compact_extra = {k: v[row : row + 1, on] for k, v in extra.items()}
            one, one_ret = compute_advantages(name, token_level_rewards=rewards[row : row + 1, on],
                                              response_mask=MASK[row : row + 1, on], gamma=0.9, lam=0.8,
                                              norm_adv_by_std=False, **compact_extra)
            if name == "gae":  # batch-independent: equal per row
                torch.testing.assert_close(full[row, on], one[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(full_ret[row, on], one_ret[0], rtol=1e-12, atol=1e-12)
            assert torch.all(full[row, ~on] == 0) and torch.all(full_ret[row, ~on] == 0)


def test_kl_in_reward_leaves_tool_tokens_alone():
    scores = torch.zeros(2, RESP_LEN)
    scores[0, 13] = 1.0
    log_probs, ref = -torch.rand(2, RESP_LEN), -torch.rand(2, RESP_LEN)
    rewards, _ = apply_kl_in_reward(scores, log_probs, ref, MASK, kl_coef=0.5)
    assert torch.equal(rewards[~MASK.bool()], scores[~MASK.bool()])
    assert not torch.equal(rewards[MASK.bool()], scores[MASK.bool()])
