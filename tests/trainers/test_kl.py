"""KL estimators (exact expectations and gradients on a two-token vocabulary), KL-in-reward with its
controllers, KL-as-loss, and the algorithm config's KL/value/DAPO knobs."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.config import AlgorithmConfig
from trainers.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)

PI = [0.5, 0.5]
PI_REF = [0.9, 0.1]


def expected_value_and_gradient(estimator, pi=PI, pi_ref=PI_REF):
    """Exact E_{x~pi}[k(x)] and E_{x~pi}[d k(x) / d logits], enumerating the two tokens (samples held fixed:
    the weights pi(x) are constants, the gradient flows through log pi(x) only)."""
    logits = torch.log(torch.tensor(pi, dtype=torch.float64)).requires_grad_(True)
    log_pi = torch.log_softmax(logits, dim=-1)
    log_ref = torch.log(torch.tensor(pi_ref, dtype=torch.float64))
    per_token = kl_penalty(log_pi, log_ref, estimator)
    expectation = (log_pi.exp().detach() * per_token).sum()
    expectation.backward()
    return expectation.item(), logits.grad


def test_k3_expectation_is_the_reverse_kl_0_5108():
    value, _ = expected_value_and_gradient("k3_unclamped")
    assert value == pytest.approx(0.5108, abs=1e-4)
    reverse_kl = sum(p * math.log(p / q) for p, q in zip(PI, PI_REF, strict=True))
    assert value == pytest.approx(reverse_kl, abs=1e-12)
    assert expected_value_and_gradient("k1")[0] == pytest.approx(reverse_kl, abs=1e-12)  # k1 unbiased too


def test_k1_as_loss_has_zero_expected_gradient():
    _, grad = expected_value_and_gradient("k1")
    assert torch.allclose(grad, torch.zeros(2, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("estimator", ["k2", "mse"])
def test_k2_as_loss_gives_reverse_kl_gradient(estimator):
    _, grad = expected_value_and_gradient(estimator)
    assert torch.allclose(grad, torch.tensor([-0.549, 0.549], dtype=torch.float64), atol=5e-4)
    # ... which is exactly the gradient of KL(pi || pi_ref) in the logits
    logits = torch.log(torch.tensor(PI, dtype=torch.float64)).requires_grad_(True)
    p = torch.softmax(logits, -1)
    (p * (p.log() - torch.tensor(PI_REF, dtype=torch.float64).log())).sum().backward()
    assert torch.allclose(grad, logits.grad, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k3_unclamped", "low_var_kl"])
def test_k3_as_loss_gives_forward_kl_gradient(estimator):
    _, grad = expected_value_and_gradient(estimator)
    assert torch.allclose(grad, torch.tensor([-0.400, 0.400], dtype=torch.float64), atol=1e-9)
    logits = torch.log(torch.tensor(PI, dtype=torch.float64)).requires_grad_(True)
    ref = torch.tensor(PI_REF, dtype=torch.float64)
    (ref * (ref.log() - torch.log_softmax(logits, -1))).sum().backward()  # KL(pi_ref || pi)
    assert torch.allclose(grad, logits.grad, atol=1e-12)


def test_verl_names_kl_and_abs_hand_computed():
    # log pi - log pi_ref per token: ln(0.5/0.9) = -0.587787, ln(0.5/0.1) = +1.609438.
    log_pi = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    log_ref = torch.log(torch.tensor(PI_REF, dtype=torch.float64))
    assert torch.allclose(kl_penalty(log_pi, log_ref, "kl"), torch.tensor([-0.587787, 1.609438], dtype=torch.float64),
                          atol=1e-6)
    assert torch.allclose(kl_penalty(log_pi, log_ref, "abs"), torch.tensor([0.587787, 1.609438], dtype=torch.float64),
                          atol=1e-6)


def test_k3_is_verls_clamped_k3_and_k3_unclamped_is_not():
    log_probs, ref = torch.tensor([0.0, -1.0]), torch.tensor([-30.0, -1.5])
    # log_r = log ref - log pi = -30 (clamped to -20) and -0.5: k3 = e^-0.5 - 1 + 0.5 = 0.106531.
    expected = torch.tensor([math.exp(-20) - 1 + 20, math.exp(-0.5) - 1 + 0.5]).clamp(max=10.0)
    assert torch.allclose(kl_penalty(log_probs, ref, "k3"), expected, atol=1e-6)
    assert torch.equal(kl_penalty(log_probs, ref, "k3"), kl_penalty(log_probs, ref, "low_var_kl"))
    assert kl_penalty(log_probs, ref, "k3_unclamped")[0].item() == pytest.approx(math.exp(-30) - 1 + 30)


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k3", "low_var_kl", "k3_unclamped"])
def test_straight_through_plus_variants_keep_the_value_and_take_k2s_gradient(base):
    value, grad = expected_value_and_gradient(f"{base}+")
    assert value == pytest.approx(expected_value_and_gradient(base)[0], abs=1e-12)
    # k2's expected gradient: grad KL(pi || pi_ref) = [-0.549, 0.549] (test_k2_as_loss_gives_reverse_kl_gradient)
    assert torch.allclose(grad, expected_value_and_gradient("k2")[1], atol=1e-12)
    assert torch.allclose(grad, torch.tensor([-0.549, 0.549], dtype=torch.float64), atol=5e-4)


def test_kl_in_reward_estimator_is_validated_under_its_own_key():
    with pytest.raises(ValueError, match=r"algorithm\.kl_in_reward_estimator='k4' is not one of \[.*'abs'"):
        AlgorithmConfig(kl_in_reward_estimator="k4")
    assert AlgorithmConfig(kl_estimator="k3+", kl_in_reward_estimator="kl").kl_estimator == "k3+"


@pytest.mark.parametrize("estimator", [n for n in KL_ESTIMATORS if n != "abs"])  # |x|: no gradient at 0
def test_identical_policies_give_zero_value_and_zero_gradient(estimator):
    value, grad = expected_value_and_gradient(estimator, pi=[0.3, 0.7], pi_ref=[0.3, 0.7])
    assert value == pytest.approx(0.0, abs=1e-12)
    assert torch.allclose(grad, torch.zeros(2, dtype=torch.float64), atol=1e-12)


def test_low_var_kl_stays_finite_and_bounded():
    log_probs = torch.tensor([0.0, -80.0, -1.0])
    ref = torch.tensor([-90.0, 0.0, -1.0])
    out = kl_penalty(log_probs, ref, "low_var_kl")
    assert torch.isfinite(out).all() and out.max().item() == 10.0 and out[2].item() == 0.0
    assert kl_penalty(log_probs, ref, "k3_unclamped")[1] > 1e30  # the unclamped k3 explodes


def test_kl_penalty_errors_and_registry():
    with pytest.raises(ValueError, match="kl_estimator='kl9'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "kl9")
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k1")


# ---------------------------------------------------------------------------------------------------------
# KL-in-reward and controllers


def test_apply_kl_in_reward_hand_computed():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    k1 = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    ref = torch.full((2, 3), -2.0)
    rewards, m = apply_kl_in_reward(scores, ref + k1, ref, mask, kl_coef=0.5, estimator="k1")
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 0.25, 0.0]])
    assert torch.allclose(rewards, expected, atol=1e-6)
    assert m["kl_in_reward/kl"] == pytest.approx((0.2 + 0.45) / 2, abs=1e-6)
    assert m["kl_in_reward/coef"] == 0.5
    with pytest.raises(ValueError, match="kl_in_reward_coef must be >= 0"):
        apply_kl_in_reward(scores, ref, ref, mask, kl_coef=-1.0)


def test_adaptive_controller_follows_ziegler_update():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    assert ctrl.update(current_kl=0.2, num_samples=10) == pytest.approx(0.1 * 1.02)  # error clipped to +0.2
    assert ctrl.update(current_kl=0.11, num_samples=10) == pytest.approx(0.1 * 1.02 * 1.01)  # error 0.1
    assert ctrl.update(current_kl=0.0, num_samples=50) == pytest.approx(0.1 * 1.02 * 1.01 * 0.9)  # -0.2 * 0.5
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=0.1, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="kl_target"):
        AdaptiveKLController(0.1, 0.0, 100)


def test_fixed_controller_and_factory():
    ctrl = FixedKLController(0.05)
    assert ctrl.update(current_kl=10.0, num_samples=1000) == 0.05
    assert isinstance(make_kl_controller(AlgorithmConfig()), FixedKLController)
    adaptive = make_kl_controller(AlgorithmConfig(kl_ctrl_type="adaptive", kl_in_reward_coef=0.2, kl_target=3.0,
                                                  kl_horizon=50))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.2, 3.0, 50)


# ---------------------------------------------------------------------------------------------------------
# KL-as-loss


def test_kl_loss_token_mean_and_padding():
    log_ref = torch.log(torch.tensor([[0.9, 0.1, 0.5]]))
    log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    log_probs[0, 2] = float("nan")  # padding garbage
    log_probs.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0]])
    loss, m = kl_loss(log_probs, log_ref, mask, estimator="k3_unclamped")
    k3 = [q / p - 1 - math.log(q / p) for p, q in ((0.5, 0.9), (0.5, 0.1))]
    assert loss.item() == pytest.approx(sum(k3) / 2, abs=1e-6)
    assert m["num_tokens"] == 2.0
    loss.backward()
    # d k3 / d log pi = 1 - pi_ref / pi
    assert torch.allclose(log_probs.grad, torch.tensor([[(1 - 1.8) / 2, (1 - 0.2) / 2, 0.0]]), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# config knobs added for the algorithm library


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kl_ctrl_type": "pid"}, "algorithm.kl_ctrl_type='pid'"),
        ({"kl_in_reward_estimator": "k4"}, "algorithm.kl_in_reward_estimator='k4'"),
        ({"kl_target": 0.0}, "algorithm.kl_target must be > 0"),
        ({"kl_horizon": 0}, "algorithm.kl_horizon must be >= 1"),
        ({"cliprange_value": -1.0}, "algorithm.cliprange_value must be > 0"),
        ({"kl_loss_coef": -0.1}, "algorithm.kl_loss_coef must be >= 0"),
        ({"overlong_buffer_len": -4}, "algorithm.overlong_buffer_len must be >= 0"),
        ({"max_refill_rounds": 0}, "algorithm.max_refill_rounds must be >= 1"),
        ({"gamma": 1.5}, r"algorithm.gamma must be in \[0, 1\], got 1.5"),
    ],
)
def test_algorithm_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(**kwargs)
