"""Loss aggregation (split invariance, masking), PPO policy loss and its corrections, value loss,
entropy, and the masked metric helpers."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.losses import (
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_from_logits,
    log_probs_from_logits,
    policy_loss,
    value_loss,
)
from trainers.metrics import (
    count_tokens_and_seqs,
    masked_mean,
    masked_stats,
    masked_sum,
    masked_whiten,
    weighted_average,
)
from trainers.policy_losses import SapoConfig, VanillaConfig


def two_sequences():
    """Sequence 0: 10 valid tokens with loss 1.0; sequence 1: 90 valid tokens with loss 0.0."""
    mask = torch.zeros(2, 100, dtype=torch.int64)
    mask[0, :10] = 1
    mask[1, :90] = 1
    loss = torch.zeros(2, 100)
    loss[0, :10] = 1.0
    loss[0, 10:] = float("nan")  # padding garbage must not leak
    return loss, mask


EXPECTED = {"token-mean": 0.1, "seq-mean-token-mean": 0.5, "seq-mean-token-sum": 5.0,
            "seq-mean-token-sum-norm": 10.0 / (2 * 100), "token-sum": 10.0}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_aggregation_hand_values_one_micro_batch_of_two_and_two_of_one(mode):
    loss, mask = two_sequences()
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    assert (num_tokens, num_seqs) == (100, 2)
    kwargs = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "norm_length": 100}
    whole = aggregate_loss(loss, mask, mode, **kwargs)
    split = sum(aggregate_loss(loss[i : i + 1], mask[i : i + 1], mode, **kwargs) for i in range(2))
    assert whole.item() == pytest.approx(EXPECTED[mode], abs=1e-7)
    assert split.item() == pytest.approx(EXPECTED[mode], abs=1e-7)


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_gradient_accumulation_8x1_equals_1x8(mode):
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 12, generator=gen) < 0.7).long()
    mask[3] = 0  # one fully masked response
    weight = torch.randn(12, requires_grad=True, generator=gen)
    features = torch.randn(8, 12, generator=gen)
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    kwargs = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "norm_length": 12}
    aggregate_loss((features * weight) ** 2, mask, mode, **kwargs).backward()
    full_grad = weight.grad.clone()
    weight.grad = None
    for i in range(8):
        aggregate_loss((features[i : i + 1] * weight) ** 2, mask[i : i + 1], mode, **kwargs).backward()
    assert torch.allclose(weight.grad, full_grad, atol=1e-6)


def test_token_mean_ignores_fully_masked_response():
    loss = torch.ones(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == 1.0  # 4 / 4, not 4 / 5
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == 1.0  # one sequence counts


def test_all_masked_gives_zero_loss_zero_grads_and_clean_optimizer_state():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 5)
    opt = torch.optim.AdamW(head.parameters(), lr=0.1, weight_decay=0.0)
    before = [p.detach().clone() for p in head.parameters()]
    log_probs = torch.log_softmax(head(torch.randn(3, 6, 4)), dim=-1)[..., 0]
    mask = torch.zeros(3, 6, dtype=torch.int64)
    old = torch.full((3, 6), -float("inf"))  # garbage in padding: -inf, nan, huge advantages
    old[0] = float("nan")
    adv = torch.full((3, 6), 1e30)
    for mode in LOSS_AGG_MODES:
        loss, metrics = policy_loss(log_probs, old, adv, mask, loss_agg_mode=mode, norm_length=6,
                                    config=VanillaConfig(dual_clip_c=3.0), rollout_log_probs=old,
                                    stale_correction="tis")
        assert loss.item() == 0.0
        assert all(math.isfinite(v) for v in metrics.values()) and metrics["num_tokens"] == 0
    opt.zero_grad()
    loss.backward()
    for p in head.parameters():
        assert torch.isfinite(p.grad).all() and torch.equal(p.grad, torch.zeros_like(p))
    opt.step()
    for p, b in zip(head.parameters(), before, strict=True):
        assert torch.equal(p, b)
        state = opt.state[p]
        assert torch.isfinite(state["exp_avg"]).all() and torch.isfinite(state["exp_avg_sq"]).all()


def test_counts_reject_negative_and_unknown_mode():
    loss, mask = two_sequences()
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        aggregate_loss(loss, mask, "mean")
    with pytest.raises(ValueError, match="global_num_tokens must be >= 0"):
        aggregate_loss(loss, mask, "token-mean", global_num_tokens=-1)
    with pytest.raises(ValueError, match="needs norm_length"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="same"):
        aggregate_loss(loss[:, :5], mask, "token-mean")


# ---------------------------------------------------------------------------------------------------------
# policy loss


def test_step_zero_ratio_is_one_and_nothing_is_clipped():
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 7, generator=gen) * 3
    log_probs = old.clone().requires_grad_(True)
    adv = torch.randn(4, 7, generator=gen)
    mask = torch.ones(4, 7, dtype=torch.int64)
    mask[2, 4:] = 0
    loss, metrics = policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                config=VanillaConfig(dual_clip_c=3.0))
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_max"] == 1.0 and metrics["ratio_min"] == 1.0
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == 0.0
    assert loss.item() == pytest.approx(-masked_mean(adv, mask).item(), abs=1e-6)
    loss.backward()
    assert torch.allclose(log_probs.grad, -adv * mask / mask.sum())


def _tokens(ratios, advantages):
    ratio = torch.tensor([ratios])
    log_probs = torch.log(ratio).requires_grad_(True)
    return log_probs, torch.zeros_like(ratio), torch.tensor([advantages]), torch.ones_like(ratio)


def test_ppo_clip_higher_and_dual_clip_hand_computed():
    # clip range [0.8, 1.28]; per token: (r, A) -> loss, clipped?
    # (1.5, +1) -> -1.28 clipped; (0.5, +1) -> -0.5; (0.5, -1) -> 0.8 clipped; (1.5, -1) -> 1.5;
    # (4, -1) -> 4 without dual clip, 3 = -c*A with dual clip c = 3.
    log_probs, old, adv, mask = _tokens([1.5, 0.5, 0.5, 1.5, 4.0], [1.0, 1.0, -1.0, -1.0, -1.0])
    loss, m = policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 + 4.0) / 5, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5) and m["pg_clipfrac_lower"] == 0.0
    loss.backward()
    # d(-r A)/d log r = -r A where unclipped; 0 where clipped.
    assert torch.allclose(log_probs.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, 4.0]]) / 5, atol=1e-6)

    log_probs.grad = None
    loss, m = policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                          config=VanillaConfig(dual_clip_c=3.0))
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 + 3.0) / 5, abs=1e-6)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    loss.backward()
    assert log_probs.grad[0, 4].item() == 0.0
    assert m["ratio_max"] == pytest.approx(4.0) and m["ratio_min"] == pytest.approx(0.5)
    # ppo_kl = mean(r - 1 - log r) over the 5 tokens
    expected_kl = sum(r - 1 - math.log(r) for r in [1.5, 0.5, 0.5, 1.5, 4.0]) / 5
    assert m["ppo_kl"] == pytest.approx(expected_kl, rel=1e-5)


def test_truncated_importance_sampling_weights_and_cap():
    # ratio 1 (new == old), A = 1; w = min(pi_old / pi_rollout, 2) = [2 (capped from 3), 0.5].
    old = torch.log(torch.tensor([[0.6, 0.2]]))
    rollout = torch.log(torch.tensor([[0.2, 0.4]]))
    log_probs = old.clone().requires_grad_(True)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    loss, m = policy_loss(log_probs, old, adv, mask, rollout_log_probs=rollout, stale_correction="tis", tis_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2, abs=1e-6)
    assert m["is_weight_mean"] == pytest.approx(1.25, abs=1e-6)
    loss.backward()
    assert torch.allclose(log_probs.grad, torch.tensor([[-1.0, -0.25]]), atol=1e-6)


def test_decoupled_ppo_clips_around_the_proximal_policy():
    # behaviour (rollout) 0.25, proximal 0.5, current 0.6: r = 1.2 (clipped at 1.1), w = 2 (not truncated).
    rollout = torch.log(torch.tensor([[0.25]]))
    proximal = torch.log(torch.tensor([[0.5]]))
    old = torch.log(torch.tensor([[0.1]]))  # ignored when proximal_log_probs is given
    log_probs = torch.log(torch.tensor([[0.6]])).requires_grad_(True)
    adv = torch.ones(1, 1)
    kwargs = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1, "rollout_log_probs": rollout,
              "stale_correction": "decoupled", "tis_cap": 1.5}
    loss, m = policy_loss(log_probs, old, adv, torch.ones(1, 1), proximal_log_probs=proximal, **kwargs)
    assert loss.item() == pytest.approx(-2.0 * 1.1, abs=1e-6)
    assert m["pg_clipfrac"] == 1.0 and m["is_weight_mean"] == pytest.approx(2.0)
    # Without proximal_log_probs the proximal policy is old_log_probs.
    loss, _ = policy_loss(log_probs, proximal, adv, torch.ones(1, 1), **kwargs)
    assert loss.item() == pytest.approx(-2.0 * 1.1, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stale_correction": "tis"}, "needs rollout_log_probs"),
        ({"stale_correction": "iw", "rollout_log_probs": torch.zeros(2, 3)}, "stale_correction='iw'"),
        ({"config": SapoConfig(name="sapo")}, "policy loss 'vanilla' takes a VanillaConfig"),
        ({"rollout_log_probs": torch.zeros(2, 3)}, "stale_correction='none' would ignore"),
        ({"proximal_log_probs": torch.zeros(2, 3), "rollout_log_probs": torch.zeros(2, 3),
          "stale_correction": "tis"}, "only used by stale_correction='decoupled'"),
        ({"rollout_log_probs": torch.zeros(2, 4), "stale_correction": "tis"}, "rollout_log_probs has shape"),
    ],
)
def test_policy_loss_rejects_bad_inputs(kwargs, match):
    zeros = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        policy_loss(zeros, zeros, zeros, torch.ones(2, 3), **kwargs)


# ---------------------------------------------------------------------------------------------------------
# value loss, entropy, log-probs


def test_value_loss_clipping_hand_computed():
    # old 1.0, clip 0.2, returns 2.0: V 1.5 -> clipped 1.2, max(0.25, 0.64) -> 0.32 (no grad);
    # V 1.1 -> both 0.81 -> 0.405 (grad V - R = -0.9). token-mean = 0.3625.
    values = torch.tensor([[1.5, 1.1, 7.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.3625, abs=1e-6)
    assert m["vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, -0.45, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(values, old, returns, mask, cliprange_value=0.0)


def test_entropy_from_logits_matches_closed_forms():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    ent = entropy_from_logits(logits)
    assert ent[0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)
    random = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    reference = torch.distributions.Categorical(logits=random).entropy()
    assert torch.allclose(entropy_from_logits(random), reference, atol=1e-5)


def test_entropy_bonus_through_aggregate_loss_is_split_invariant():
    ent = entropy_from_logits(torch.randn(4, 6, 9, generator=torch.Generator().manual_seed(2)))
    mask = torch.ones(4, 6, dtype=torch.int64)
    mask[1, 2:] = 0
    counts = dict(zip(("global_num_tokens", "global_num_seqs"), count_tokens_and_seqs(mask), strict=True))
    whole = aggregate_loss(ent, mask, "token-mean", **counts)
    parts = aggregate_loss(ent[:2], mask[:2], "token-mean", **counts) + aggregate_loss(
        ent[2:], mask[2:], "token-mean", **counts
    )
    assert torch.allclose(whole, parts) and whole.item() == pytest.approx(ent[mask.bool()].mean().item(), abs=1e-6)


def test_log_probs_from_logits_matches_log_softmax():
    logits = torch.randn(2, 5, 13, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(4))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(log_probs_from_logits(logits, labels), expected, atol=1e-6)
    with pytest.raises(ValueError, match="must be labels"):
        log_probs_from_logits(logits, labels[:, :3])


# ---------------------------------------------------------------------------------------------------------
# metrics helpers


def compute_data_metrics(
    response_mask: torch.Tensor,
    *,
    advantages: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    token_level_scores: torch.Tensor | None = None,
    token_level_rewards: torch.Tensor | None = None,
) -> dict[str, float]:
    """Batch statistics of one update's data, over valid tokens only (a test-only composition of the
    metric helpers; the worker reports its own, ``TrainerWorker.compute_advantages``/``update_actor``).

    All tensors ``(batch, response_len)``. Token-level fields give ``advantages/*``, ``returns/*`` and
    ``values/*`` (mean/max/min over valid tokens); scores and rewards are summed per sequence first
    (``score/*``, ``reward/*``: per-sample totals over sequences with a valid token). Always includes
    ``response_length/mean|max|min`` (valid tokens per sequence) and ``num_tokens`` / ``num_seqs``.
    """
    metrics: dict[str, float] = {}
    for name, tensor in (("advantages", advantages), ("returns", returns), ("values", values)):
        if tensor is not None:
            metrics.update(masked_stats(tensor, response_mask, name))
    num_tokens, num_seqs = count_tokens_and_seqs(response_mask)
    seq_valid = response_mask.bool().any(dim=-1, keepdim=True)
    for name, tensor in (("score", token_level_scores), ("reward", token_level_rewards)):
        if tensor is not None:
            per_seq = masked_sum(tensor, response_mask, dim=-1).unsqueeze(-1)
            metrics.update(masked_stats(per_seq, seq_valid, name))
    lengths = response_mask.bool().sum(dim=-1, keepdim=True).float()
    metrics.update(masked_stats(lengths, torch.ones_like(seq_valid), "response_length"))
    metrics["num_tokens"] = float(num_tokens)
    metrics["num_seqs"] = float(num_seqs)
    return metrics


def test_data_metrics_use_valid_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    adv = torch.tensor([[1.0, 3.0, 100.0], [-2.0, float("nan"), 50.0], [9.0, 9.0, 9.0]])
    scores = torch.tensor([[0.0, 1.0, 5.0], [0.5, 0.0, 0.0], [7.0, 0.0, 0.0]])
    m = compute_data_metrics(mask, advantages=adv, returns=adv, token_level_scores=scores)
    assert m["advantages/mean"] == pytest.approx(2 / 3) and m["advantages/max"] == 3.0
    assert m["advantages/min"] == -2.0 and m["returns/max"] == 3.0
    assert m["score/mean"] == pytest.approx(0.75) and m["score/max"] == 1.0  # the masked row is excluded
    assert m["response_length/mean"] == pytest.approx(1.0) and m["response_length/max"] == 2.0
    assert m["num_tokens"] == 3.0 and m["num_seqs"] == 2.0


def test_masked_whiten_and_weighted_average():
    x = torch.tensor([[1.0, 2.0, 3.0, 1e9]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert torch.allclose(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)
    merged = weighted_average([{"pg_loss": 1.0, "ratio_max": 2.0, "num_tokens": 3},
                               {"pg_loss": 3.0, "ratio_max": 1.5, "num_tokens": 1},
                               {"pg_loss": 99.0, "ratio_max": 99.0, "num_tokens": 0}])
    assert merged == {"pg_loss": 1.5, "ratio_max": 2.0, "num_tokens": 4.0}
    with pytest.raises(ValueError, match="num_tokens"):
        weighted_average([{"pg_loss": 1.0}])
