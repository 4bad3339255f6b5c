"""Advantage estimators: the handed GRPO cases, uid grouping invariants and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)


def outcome_rewards(scores, response_len=3, lengths=None, dtype=torch.float32):
    """(batch, response_len) rewards with each score on the last valid token, and the mask."""
    batch = len(scores)
    lengths = lengths or [response_len] * batch
    mask = torch.zeros(batch, response_len, dtype=torch.int64)
    rewards = torch.zeros(batch, response_len, dtype=dtype)
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return rewards, mask


# ---------------------------------------------------------------------------------------------------------
# handed GRPO cases


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_grpo_all_equal_rewards_give_exact_zero(norm_adv_by_std):
    rewards, mask = outcome_rewards([1.0] * 4)
    adv, ret = grpo_advantages(rewards, mask, ["a"] * 4, norm_adv_by_std=norm_adv_by_std)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert torch.equal(ret, torch.zeros_like(ret))


def test_grpo_equal_fp32_rewards_0_35_exact_zero_through_std_path():
    rewards, mask = outcome_rewards([0.35] * 4, dtype=torch.float32)
    adv, _ = grpo_advantages(rewards, mask, ["a"] * 4, norm_adv_by_std=True, epsilon=1e-6)
    assert adv.dtype == torch.float32
    assert torch.equal(adv, torch.zeros_like(adv))
    assert not torch.isnan(adv).any()


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_of_one_gives_zero_not_nan(estimator):
    rewards, mask = outcome_rewards([0.7, 1.0, 0.0])
    adv, ret = compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask, uid=["x", "y", "y"])
    assert not torch.isnan(adv).any() and not torch.isnan(ret).any()
    assert torch.equal(adv[0], torch.zeros(3))


def test_grpo_hand_computed_values():
    # A = [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866025 on valid tokens.
    rewards, mask = outcome_rewards([1, 0, 1, 0], response_len=4, lengths=[4, 2, 3, 1])
    adv, _ = grpo_advantages(rewards, mask, [7] * 4, epsilon=0.0)
    expected = 0.5 / math.sqrt(1 / 3)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(-1)
    assert torch.allclose(adv, signs * expected * mask, atol=1e-6)
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))


# ---------------------------------------------------------------------------------------------------------
# grouping by uid, never by position

UIDS = ["A"] * 4 + ["B"] * 4
SCORES = [1, 0, 1, 0, 0, 0, 1, 1]
GROUP_ESTIMATORS = ["grpo", "drgrpo", "rloo", "remax"]


def _run(estimator, rewards, mask, uid):
    batch = rewards.shape[0]
    baseline = torch.linspace(0.1, 0.8, 8)[:batch] if estimator == "remax" else None
    return compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask, uid=uid,
                              values=torch.full_like(rewards, 0.25), remax_baseline=baseline)[0]


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATORS))
def test_shuffling_the_batch_leaves_each_advantage_unchanged(estimator):
    rewards, mask = outcome_rewards(SCORES, response_len=4, lengths=[4, 3, 2, 4, 1, 4, 3, 2])
    adv = _run(estimator, rewards, mask, UIDS)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    if estimator == "remax":  # the baseline travels with its sample
        baseline = torch.linspace(0.1, 0.8, 8)
        shuffled = compute_advantages("remax", token_level_rewards=rewards[perm], response_mask=mask[perm],
                                      remax_baseline=baseline[perm])[0]
    else:
        shuffled = _run(estimator, rewards[perm], mask[perm], [UIDS[i] for i in perm])
    assert torch.allclose(shuffled, adv[perm], atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_dropping_a_sample_of_group_a_leaves_group_b_unchanged(estimator):
    rewards, mask = outcome_rewards(SCORES)
    adv = _run(estimator, rewards, mask, UIDS)
    keep = [0, 1, 2, 4, 5, 6, 7]  # A's 4th sample dropped
    dropped = _run(estimator, rewards[keep], mask[keep], [UIDS[i] for i in keep])
    assert torch.equal(dropped[3:], adv[4:])
    assert not torch.equal(dropped[:3], adv[:3])  # group A itself did change


def test_uid_may_be_a_tensor_and_interleaved():
    rewards, mask = outcome_rewards([1, 0, 0, 1])
    by_list, _ = grpo_advantages(rewards, mask, ["p", "q", "p", "q"])
    by_tensor, _ = grpo_advantages(rewards, mask, torch.tensor([3, 9, 3, 9]))
    assert torch.equal(by_list, by_tensor)
    assert by_list[0, 0] > 0 and by_list[2, 0] < 0


# ---------------------------------------------------------------------------------------------------------
# hand-computed GAE, RLOO, REINFORCE++


def test_gae_three_token_hand_computed():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lam 0.8, V after the last valid token = 0.
    # delta = [0.04, 0.03, 0.3]; A2 = 0.3; A1 = 0.03 + 0.72 * 0.3 = 0.246; A0 = 0.04 + 0.72 * 0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 5.0]])  # the padded value must be ignored
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, mask, values, gamma=0.9, lam=0.8, norm_adv_by_std=False)
    assert torch.allclose(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]), atol=1e-6)


def test_gae_whitened_over_valid_tokens():
    rewards, mask = outcome_rewards([1.0, 0.0], response_len=4, lengths=[4, 2])
    values = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    adv, _ = gae_advantages(rewards, mask, values, gamma=1.0, lam=0.95, norm_adv_by_std=True)
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-6
    assert abs(valid.std().item() - 1.0) < 1e-4
    assert torch.equal(adv[~mask.bool()], torch.zeros(2))


def test_rloo_hand_computed():
    # Leave-one-out baselines: (0.5+0+0.25)/3, (1+0+0.25)/3, (1+0.5+0.25)/3, (1+0.5+0)/3.
    rewards, mask = outcome_rewards([1.0, 0.5, 0.0, 0.25])
    adv, ret = rloo_advantages(rewards, mask, ["g"] * 4)
    expected = torch.tensor([0.75, 0.5 - 1.25 / 3, -1.75 / 3, -0.25])
    assert torch.allclose(adv[:, 0], expected, atol=1e-6)
    assert torch.equal(ret, adv)


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5: returns [0.25, 0.5, 1] and [0.25, 0.5, pad]; valid mean 0.5, unbiased var 0.375 / 4.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [0.25, 0.5, 0.0]]))
    std = math.sqrt(0.375 / 4)
    expected = torch.tensor([[-0.25, 0.0, 0.5], [-0.25, 0.0, 0.0]]) / std
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_plus_plus_baseline_hand_computed():
    # Groups [1, 0] and [1, 1]: centred [0.5, -0.5, 0, 0]; unbiased std over 4 tokens sqrt(0.5 / 3).
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0], response_len=1)
    adv, _ = reinforce_plus_plus_baseline_advantages(rewards, mask, ["a", "a", "b", "b"])
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / math.sqrt(0.5 / 3)
    assert torch.allclose(adv[:, 0], expected, atol=1e-5)


def test_remax_subtracts_the_greedy_baseline():
    rewards, mask = outcome_rewards([1.0, 0.0], response_len=3, lengths=[3, 2])
    adv, ret = compute_advantages("remax", token_level_rewards=rewards, response_mask=mask,
                                  remax_baseline=torch.tensor([0.25, 0.5]))
    assert torch.allclose(adv, torch.tensor([[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_discounted_returns_skip_padding():
    rewards = torch.tensor([[1.0, 9.0, 2.0]])  # the 9 sits on a masked position
    mask = torch.tensor([[1, 0, 1]])
    assert torch.allclose(discounted_returns(rewards, mask, gamma=0.5), torch.tensor([[2.0, 0.0, 2.0]]))


# ---------------------------------------------------------------------------------------------------------
# registry and errors


def test_advantages_carry_no_gradient():
    rewards, mask = outcome_rewards([1.0, 0.0])
    rewards.requires_grad_(True)
    adv, ret = compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, uid=[0, 0])
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"estimator": "ppo"}, "adv_estimator"),
        ({"estimator": "gae"}, "needs values"),
        ({"estimator": "remax"}, "needs remax_baseline"),
        ({"estimator": "grpo"}, "needs uid"),
        ({"estimator": "grpo", "uid": ["a"]}, "uid has 1 entries but the batch has 2"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, match):
    rewards, mask = outcome_rewards([1.0, 0.0])
    estimator = kwargs.pop("estimator")
    with pytest.raises(ValueError, match=match):
        compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask, **kwargs)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="response_mask has shape"):
        grpo_advantages(torch.zeros(2, 3), torch.ones(2, 4), [0, 0])
