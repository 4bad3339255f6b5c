"""Policy-loss plug-ins (``algorithm.policy_loss``) on one hand-worked micro-batch, and their config checks.

The batch: two sequences, the second one token shorter; probabilities before (``P_OLD``) and now (``P``)
give the token ratios ``r = P / P_OLD``; advantages +1 (sequence 0) and -2 (sequence 1)::

    seq 0:  p_old 0.4  0.6  0.5    p 0.6  0.3   0.5    r 1.5  0.5  1.0    A +1
    seq 1:  p_old 0.5  0.5  (pad)  p 0.55 0.35  (pad)  r 1.1  0.7         A -2

Each expected value below is the paper's formula worked out by hand on these numbers (5 valid tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from trainers.config import AlgorithmConfig
from trainers.losses import policy_loss
from trainers.policy_losses import POLICY_LOSSES, PolicyLossParams

P_OLD = [[0.4, 0.6, 0.5], [0.5, 0.5, 0.9]]
P = [[0.6, 0.3, 0.5], [0.55, 0.35, 0.1]]  # the pad column is garbage and must not matter
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
LN = math.log


def run(loss_mode, **kwargs):
    """(loss, metrics, d loss / d log_probs) of ``loss_mode`` on the batch above, in float64."""
    log_probs = torch.log(torch.tensor(P, dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor(P_OLD, dtype=torch.float64))
    adv, mask = torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK)
    params = PolicyLossParams(**kwargs)
    loss, metrics = policy_loss(log_probs, old, adv, mask, loss_mode=loss_mode, params=params)
    loss.backward()
    return loss.item(), metrics, log_probs.grad


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_vanilla_is_clipped_ppo():
    # clip [0.8, 1.2]: seq 0: max(-1.5, -1.2) = -1.2 (clipped), max(-0.5, -0.8) = -0.5, -1;
    # seq 1 (A = -2): max(2.2, 2.2) = 2.2, max(1.4, 1.6) = 1.6 (clipped). Token mean of 5.
    loss, m, grad = run("vanilla")
    assert loss == pytest.approx((-1.2 - 0.5 - 1.0 + 2.2 + 1.6) / 5)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    # d(-A r)/d log p = -A r on unclipped tokens, 0 on clipped ones.
    assert torch.allclose(grad, torch.tensor([[0.0, -0.5, -1.0], [2.2, 0.0, 0.0]], dtype=torch.float64) / 5)


def test_cispo_keeps_every_gradient_with_a_clipped_weight():
    # w = sg(clip(r, 0.8, 1.2)) = 1.2, 0.8, 1.0 | 1.1, 0.8; loss = -w A log p; clipped: r = 1.5, 0.5, 0.7.
    loss, m, grad = run("cispo")
    expected = -1.2 * LN(0.6) - 0.8 * LN(0.3) - 1.0 * LN(0.5) + 2 * 1.1 * LN(0.55) + 2 * 0.8 * LN(0.35)
    assert loss == pytest.approx(expected / 5)
    assert m["pg_clipfrac"] == pytest.approx(3 / 5)
    assert torch.allclose(grad, torch.tensor([[-1.2, -0.8, -1.0], [2.2, 1.6, 0.0]], dtype=torch.float64) / 5)


def test_gpg_is_plain_policy_gradient():
    loss, _, grad = run("gpg")
    assert loss == pytest.approx((-(LN(0.6) + LN(0.3) + LN(0.5)) + 2 * (LN(0.55) + LN(0.35))) / 5)
    assert torch.allclose(grad, torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 0.0]], dtype=torch.float64) / 5)


def test_gspo_uses_the_sequence_ratio_and_a_mean_over_sequences():
    # s_0 = (1.5 * 0.5 * 1.0)^(1/3) = 0.75^(1/3), s_1 = (1.1 * 0.7)^(1/2) = 0.77^(1/2); seq-mean-token-mean.
    s0, s1 = 0.75 ** (1 / 3), 0.77**0.5
    loss, m, grad = run("gspo")  # clip [0.8, 1.2]: both inside
    assert loss == pytest.approx((-1 * s0 + 2 * s1) / 2)
    assert m["pg_clipfrac"] == 0.0
    # d/d log p_t of (1/2) * (1/|y|) * sum_t -A s_i e^{log p_t - sg(log p_t)} = -A s_i / (2 |y_i|).
    expected_grad = torch.tensor([[-s0 / 6] * 3, [s1 / 2, s1 / 2, 0.0]], dtype=torch.float64)
    assert torch.allclose(grad, expected_grad)
    # clip [0.95, 1.05]: seq 1 (A < 0, s_1 = 0.877 < 0.95) takes the clipped 2 * 0.95 and loses its gradient.
    loss, m, grad = run("gspo", clip_ratio_low=0.05, clip_ratio_high=0.05)
    assert loss == pytest.approx((-s0 + 2 * 0.95) / 2)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert torch.equal(grad[1], torch.zeros(3, dtype=torch.float64))


def test_sapo_soft_gate():
    # f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau; tau = 1 for A > 0, 1.05 for A < 0; loss = -f A.
    # seq 0: -(4 sigmoid(0.5) + 4 sigmoid(-0.5) + 2) / 3 = -(4 + 2) / 3 = -2.
    # seq 1: 2 * (4 / 1.05) * (sigmoid(0.105) + sigmoid(-0.315)) / 2.
    loss, _, _ = run("sapo")
    seq1 = (4 / 1.05) * (sigmoid(1.05 * 0.1) + sigmoid(1.05 * -0.3))
    assert loss == pytest.approx((-2.0 + seq1) / 2)


def test_sapo_gradient_at_ratio_one_equals_ppo():
    log_probs = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = policy_loss(log_probs, torch.zeros(1, 2, dtype=torch.float64), adv, torch.ones(1, 2),
                          loss_mode="sapo", params=PolicyLossParams(sapo_tau_pos=1.0, sapo_tau_neg=3.0))
    loss.backward()
    # f'(1) = tau * 1/4 * 4 / tau = 1, so d loss / d log p = -A * r / 2 = -A / 2 (one sequence of 2 tokens).
    assert torch.allclose(log_probs.grad, torch.tensor([[-0.5, 0.5]], dtype=torch.float64))


def test_geo_mean_clips_log_ratios_and_takes_the_geometric_mean():
    # eps = 0.4 on log r. seq 0 (A > 0): d = ln 1.5 = 0.405 -> 0.4, ln 0.5 = -0.693 stays (min with the
    # clamp -0.4 keeps -0.693), 0 -> ratio exp((0.4 + ln 0.5) / 3); seq 1 (A < 0): ln 1.1, ln 0.7 inside.
    loss, m, _ = run("geo_mean", clip_ratio_low=0.4, clip_ratio_high=0.4)
    assert loss == pytest.approx((-math.exp((0.4 + LN(0.5)) / 3) + 2 * 0.77**0.5) / 2)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5) and m["pg_clipfrac_lower"] == 0.0


def test_dppo_tv_drops_tokens_outside_the_probability_trust_region():
    # eps = 0.1 on p - p_old: seq 0 (A > 0): +0.2 out, -0.3 in, 0 in; seq 1 (A < 0): +0.05 in, -0.15 out.
    # loss = -A * sg(min(r, 20)) * log p on the tokens in.
    loss, m, grad = run("dppo_tv", clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert loss == pytest.approx((-0.5 * LN(0.3) - 1.0 * LN(0.5) + 2 * 1.1 * LN(0.55)) / 5)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert torch.allclose(grad, torch.tensor([[0.0, -0.5, -1.0], [2.2, 0.0, 0.0]], dtype=torch.float64) / 5)


def test_dppo_kl_uses_the_binary_kl():
    # binary KL: (0.4 -> 0.6) = 0.4 ln(0.4/0.6) + 0.6 ln(0.6/0.4) = 0.2 ln 1.5 = 0.081 > 0.05: out (A > 0, rose);
    # (0.5 -> 0.35) = 0.5 ln(0.5/0.35) + 0.5 ln(0.5/0.65) = 0.047 <= 0.05: in. Moves against A's sign stay in.
    loss, m, _ = run("dppo_kl", clip_ratio_low=0.05, clip_ratio_high=0.05)
    expected = -0.5 * LN(0.3) - 1.0 * LN(0.5) + 2 * 1.1 * LN(0.55) + 2 * 0.7 * LN(0.35)
    assert loss == pytest.approx(expected / 5)
    assert m["pg_clipfrac"] == pytest.approx(1 / 5)


# Token covariances (A - mean A)(log p - mean log p) over the 5 valid tokens: mean A = -0.2,
# mean log p = (ln .6 + ln .3 + ln .5 + ln .55 + ln .35) / 5 = -0.81112:
#   (0,0) 1.2 * 0.30030 = 0.36035   (0,1) 1.2 * -0.39285 = -0.47142   (0,2) 1.2 * 0.11797 = 0.14157
#   (1,0) -1.8 * 0.21328 = -0.38391 (1,1) -1.8 * -0.23870 = 0.42966


def test_clip_cov_detaches_the_covariance_window_tokens():
    # PPO already clips (0,0) and (1,1); in (0.1, 5) remains (0,2) only; max(1, int(0.2 * 5)) = 1 token.
    loss, m, grad = run("clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.1, clip_cov_ub=5.0)
    assert loss == pytest.approx((-1.2 - 0.5 + 0.0 + 2.2 + 1.6) / 5)
    assert m["pg_clipfrac"] == pytest.approx(1 / 5)
    assert grad[0, 2].item() == 0.0 and grad[0, 1].item() == pytest.approx(-0.5 / 5)


def test_kl_cov_penalises_the_largest_covariance_tokens():
    # Unclipped -A r everywhere; the top 1 covariance token (1,1) adds 0.1 * |ln 0.7|.
    loss, m, _ = run("kl_cov", kl_cov_ratio=0.2, kl_cov_coef=0.1)
    assert loss == pytest.approx((-1.5 - 0.5 - 1.0 + 2.2 + 1.4 + 0.1 * abs(LN(0.7))) / 5)
    assert m["pg_clipfrac"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_loss_ignores_padding_and_is_zero_on_an_empty_batch(name):
    log_probs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = policy_loss(log_probs, torch.full((2, 3), float("nan")), torch.full((2, 3), 1e30),
                                torch.zeros(2, 3), loss_mode=name)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(log_probs.grad, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in metrics.values())


def test_config_selects_and_validates_policy_losses():
    assert AlgorithmConfig().policy_loss == "vanilla"
    assert AlgorithmConfig(policy_loss="cispo", clip_ratio_high=0.28).policy_loss == "cispo"
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss='ppo2' is not one of \[.*'gspo'"):
        AlgorithmConfig(policy_loss="ppo2")
    with pytest.raises(ValueError, match=r"algorithm\.sapo_tau_neg=2\.0 is not used by algorithm\.policy_loss="
                                         r"'vanilla'.*\['sapo'\]"):
        AlgorithmConfig(sapo_tau_neg=2.0)
    with pytest.raises(ValueError, match=r"algorithm\.dual_clip_c=3\.0 is not used by .*'gspo'"):
        AlgorithmConfig(policy_loss="gspo", dual_clip_c=3.0)
    for key, value in (("sapo_tau_pos", 0.0), ("kl_cov_coef", -1.0), ("dppo_ratio_cap", float("nan")),
                       ("clip_cov_ratio", 0.0), ("kl_cov_ratio", 1.5)):
        with pytest.raises(ValueError, match=rf"algorithm\.{key}"):
            AlgorithmConfig(**{key: value})
    with pytest.raises(ValueError, match=r"algorithm\.clip_cov_lb=5\.0 must be < algorithm\.clip_cov_ub=5\.0"):
        AlgorithmConfig(policy_loss="clip_cov", clip_cov_lb=5.0)


def test_params_come_from_the_config():
    cfg = AlgorithmConfig(policy_loss="sapo", sapo_tau_pos=1.5, sapo_tau_neg=2.5)
    params = PolicyLossParams.from_config(cfg)
    assert (params.sapo_tau_pos, params.sapo_tau_neg, params.clip_ratio_low) == (1.5, 2.5, 0.2)


def test_a_policy_loss_from_outside_the_package_by_module_name():
    # tests/trainers/plugin_policy_loss.py: l = -A r, token mean of -1.5, -0.5, -1.0 | 2.2, 1.4.
    spec = "tests.trainers.plugin_policy_loss:unclipped"
    AlgorithmConfig(policy_loss=spec)  # validated against the registry, the module imported by the lookup
    loss, m, grad = run(spec)
    assert loss == pytest.approx((-1.5 - 0.5 - 1.0 + 2.2 + 1.4) / 5)
    assert m["pg_clipfrac"] == 0.0
    assert torch.allclose(grad, torch.tensor([[-1.5, -0.5, -1.0], [2.2, 1.4, 0.0]], dtype=torch.float64) / 5)
    with pytest.raises(ValueError, match="registered no policy loss named 'nope'"):
        AlgorithmConfig(policy_loss="tests.trainers.plugin_policy_loss:nope")
