"""DAPO dynamic sampling (zero-variance group filter, refill count) and overlong reward shaping."""

from __future__ import annotations

import pytest
import torch

from trainers.advantages import grpo_advantages
from trainers.dapo import apply_overlong_penalty, filter_zero_variance_groups, overlong_penalty

UIDS = ["A"] * 4 + ["B"] * 4 + ["C"] * 4
SCORES = torch.tensor([1.0, 0, 1, 0] + [1.0] * 4 + [0.0] * 4)


def test_zero_variance_groups_are_dropped_and_refill_is_counted():
    result = filter_zero_variance_groups(UIDS, SCORES, target_num_groups=3)
    assert result.kept_uids == ["A"] and result.dropped_uids == ["B", "C"]
    assert result.keep_mask.tolist() == [True] * 4 + [False] * 8
    assert result.num_groups_to_refill == 2
    assert filter_zero_variance_groups(UIDS, SCORES).num_groups_to_refill == 2  # no target: = dropped
    assert filter_zero_variance_groups(UIDS, SCORES, target_num_groups=1).num_groups_to_refill == 0


def test_filter_groups_by_uid_not_position():
    perm = torch.tensor([11, 0, 5, 2, 8, 1, 3, 9, 4, 6, 10, 7])
    uids = [UIDS[i] for i in perm]
    result = filter_zero_variance_groups(uids, SCORES[perm])
    assert sorted(result.kept_uids) == ["A"] and sorted(result.dropped_uids) == ["B", "C"]
    assert result.keep_mask.tolist() == [u == "A" for u in uids]


def test_dropped_groups_are_exactly_those_with_zero_grpo_advantage():
    rewards = torch.zeros(12, 2)
    rewards[:, 1] = SCORES
    adv, _ = grpo_advantages(rewards, torch.ones(12, 2), UIDS)
    result = filter_zero_variance_groups(UIDS, SCORES)
    assert torch.equal(adv[~result.keep_mask], torch.zeros(8, 2))
    assert (adv[result.keep_mask].abs() > 0).all()


def test_single_sample_groups_and_tolerance():
    result = filter_zero_variance_groups(["x", "y", "y"], torch.tensor([1.0, 0.5, 0.5 + 1e-9]), atol=1e-6)
    assert result.kept_uids == [] and result.dropped_uids == ["x", "y"]
    assert filter_zero_variance_groups(["y", "y"], torch.tensor([0.5, 0.5 + 1e-3]), atol=1e-6).kept_uids == ["y"]
    with pytest.raises(ValueError, match="uid has 2 entries"):
        filter_zero_variance_groups(["a", "b"], torch.zeros(3))
    with pytest.raises(ValueError, match="seq_scores must be"):
        filter_zero_variance_groups(["a"], torch.zeros(1, 1))


def test_overlong_penalty_hand_computed():
    # L_max 20, L_cache 4: free up to 16, linear to -1 at 20, -1 beyond.
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    penalty = overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4)
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=0.5)
    assert torch.allclose(half, penalty * 0.5)
    with pytest.raises(ValueError, match="overlong_buffer_len must be in"):
        overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=0)
    with pytest.raises(ValueError, match="overlong_penalty_factor"):
        overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=-1.0)


def test_apply_overlong_penalty_on_last_valid_token():
    mask = torch.zeros(3, 8, dtype=torch.int64)
    mask[0, :8] = 1  # 8 tokens: (6 - 8) / 2 = -1
    mask[1, :7] = 1  # 7 tokens: -0.5
    scores = torch.zeros(3, 8)
    scores[0, 7] = 1.0
    scores[1, 6] = 1.0  # row 2 is fully masked: unchanged
    out, m = apply_overlong_penalty(scores, mask, max_response_length=8, overlong_buffer_len=2)
    expected = scores.clone()
    expected[0, 7] = 0.0
    expected[1, 6] = 0.5
    assert torch.equal(out, expected)
    assert m["overlong/frac_penalised"] == pytest.approx(2 / 3)
    assert torch.equal(scores[0, 7], torch.tensor(1.0))  # input not modified in place
