"""Policy-loss plug-ins (``algorithm.policy_loss``) on one hand-worked micro-batch, and their config checks.

The batch: two sequences, the second one token shorter; probabilities before (``P_OLD``) and now (``P``)
give the token ratios ``r = P / P_OLD``; advantages +1 (sequence 0) and -2 (sequence 1)::

    seq 0:  p_old 0.4  0.6  0.5    p 0.6  0.3   0.5    r 1.5  0.5  1.0    A +1
    seq 1:  p_old 0.5  0.5  (pad)  p 0.55 0.35  (pad)  r 1.1  0.7         A -2

Each expected value below is the paper's formula worked out by hand on these numbers (5 valid tokens).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from controller.config import load_config
from trainers.config import AlgorithmConfig
from trainers.losses import policy_loss
from trainers.policy_losses import POLICY_LOSSES, ClipCovConfig, SapoConfig, VanillaConfig

P_OLD = [[0.4, 0.6, 0.5], [0.5, 0.5, 0.9]]
P = [[0.6, 0.3, 0.5], [0.55, 0.35, 0.1]]  # the pad column is garbage and must not matter
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
LN = math.log


def run(loss_mode, config=None, **clip):
    """(loss, metrics, d loss / d log_probs) of ``loss_mode`` on the batch above, in float64, with the shared
    clip ratios ``clip`` and the loss's own settings ``config`` (None = its defaults)."""
    log_probs = torch.log(torch.tensor(P, dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor(P_OLD, dtype=torch.float64))
    adv, mask = torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK)
    loss, metrics = policy_loss(log_probs, old, adv, mask, loss_mode=loss_mode, config=config, **clip)
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
                          loss_mode="sapo", config=SapoConfig(name="sapo", tau_pos=1.0, tau_neg=3.0))
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
    loss, m, grad = run("clip_cov", POLICY_LOSSES.config("clip_cov")(name="clip_cov", ratio=0.2, lb=0.1, ub=5.0))
    assert loss == pytest.approx((-1.2 - 0.5 + 0.0 + 2.2 + 1.6) / 5)
    assert m["pg_clipfrac"] == pytest.approx(1 / 5)
    assert grad[0, 2].item() == 0.0 and grad[0, 1].item() == pytest.approx(-0.5 / 5)


def test_kl_cov_penalises_the_largest_covariance_tokens():
    # Unclipped -A r everywhere; the top 1 covariance token (1,1) adds 0.1 * |ln 0.7|.
    loss, m, _ = run("kl_cov", POLICY_LOSSES.config("kl_cov")(name="kl_cov", ratio=0.2, coef=0.1))
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
    assert AlgorithmConfig().policy_loss == VanillaConfig(name="vanilla", dual_clip_c=0.0)
    cispo = AlgorithmConfig(policy_loss=POLICY_LOSSES.config("cispo")(name="cispo"), clip_ratio_high=0.28)
    assert cispo.policy_loss.name == "cispo"
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss\.name='ppo2' is not one of \[.*'gspo'"):
        AlgorithmConfig(policy_loss=VanillaConfig(name="ppo2"))
    with pytest.raises(ValueError, match=r"algorithm\.clip_ratio_high=0\.3 is not used by algorithm\.policy_loss\."
                                         r"name='sapo'.*'vanilla'"):
        AlgorithmConfig(policy_loss=SapoConfig(name="sapo"), clip_ratio_high=0.3)
    with pytest.raises(ValueError, match=r"policy loss 'gspo' takes a PolicyLossConfig"):
        AlgorithmConfig(policy_loss=VanillaConfig(name="gspo", dual_clip_c=3.0))
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss='sapo' is now spelled algorithm\.policy_loss\.name=sapo"):
        AlgorithmConfig(policy_loss="sapo")
    for cls, key, value in ((SapoConfig, "tau_pos", 0.0), (POLICY_LOSSES.config("kl_cov"), "coef", -1.0),
                            (POLICY_LOSSES.config("dppo_tv"), "ratio_cap", float("nan")),
                            (ClipCovConfig, "ratio", 0.0), (POLICY_LOSSES.config("kl_cov"), "ratio", 1.5)):
        with pytest.raises(ValueError, match=rf"algorithm\.policy_loss\.{key} must be"):
            cls(**{key: value})
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss\.lb=5\.0 must be < algorithm\.policy_loss\.ub=5\.0"):
        ClipCovConfig(name="clip_cov", lb=5.0)
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss\.dual_clip_c must be 0 \(off\) or > 1, got 0\.5"):
        VanillaConfig(dual_clip_c=0.5)


def test_a_policy_losss_settings_nest_under_its_name_in_the_config_tree():
    cfg = load_config(preset="tiny", overrides=["algorithm.policy_loss.name=sapo", "algorithm.policy_loss.tau_pos=1.5",
                                                "algorithm.policy_loss.tau_neg=2.5"])
    assert cfg.algorithm.policy_loss == SapoConfig(name="sapo", tau_pos=1.5, tau_neg=2.5)
    assert load_config(preset="tiny").algorithm.policy_loss == VanillaConfig()
    dual = load_config(preset="tiny", overrides=["algorithm.policy_loss.dual_clip_c=3"]).algorithm.policy_loss
    assert dual == VanillaConfig(dual_clip_c=3.0)  # vanilla's own setting, the name left at its default
    with pytest.raises(ValueError, match=r"unknown config key 'algorithm\.policy_loss\.tau_pos' \(from override "
                                         r"'algorithm\.policy_loss\.tau_pos=2'\): policy loss 'vanilla' takes "
                                         r"\['name', 'dual_clip_c'\]"):
        load_config(preset="tiny", overrides=["algorithm.policy_loss.tau_pos=2"])
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss\.tau_pos must be > 0, got -1\.0"):
        load_config(preset="tiny", overrides=["algorithm.policy_loss.name=sapo", "algorithm.policy_loss.tau_pos=-1"])
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss\.name='nope' is not one of .*\(from override"):
        load_config(preset="tiny", overrides=["algorithm.policy_loss.name=nope"])


@pytest.mark.parametrize("override, new", [
    ("algorithm.policy_loss=sapo", "algorithm.policy_loss.name=sapo"),
    ("algorithm.sapo_tau_pos=1.5", "algorithm.policy_loss.tau_pos (with algorithm.policy_loss.name=sapo)"),
    ("algorithm.dual_clip_c=3", "algorithm.policy_loss.dual_clip_c (with algorithm.policy_loss.name=vanilla)"),
    ("algorithm.clip_cov_lb=0.5", "algorithm.policy_loss.lb (with algorithm.policy_loss.name=clip_cov)"),
    ("algorithm.dppo_ratio_cap=5", "algorithm.policy_loss.ratio_cap"),
])
def test_an_old_flat_spelling_is_refused_with_the_new_key(override, new, tmp_path):
    with pytest.raises(ValueError, match="is now spelled " + re.escape(new)):
        load_config(preset="tiny", overrides=[override])
    # The same in a YAML file, e.g. the config.yaml of a run a resume reads.
    key, _, value = override.partition("=")
    section, name = key.split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ValueError, match=re.escape(f"{key} (from {tmp_path / 'old.yaml'})") + "|" +
                       re.escape(f"{key}={value!r} (from {tmp_path / 'old.yaml'})")):
        load_config(config_file=str(tmp_path / "old.yaml"))


def test_a_policy_loss_from_outside_the_package_by_module_name():
    # tests/trainers/plugin_policy_loss.py: l = -A r, token mean of -1.5, -0.5, -1.0 | 2.2, 1.4.
    spec = "tests.trainers.plugin_policy_loss:unclipped"
    AlgorithmConfig(policy_loss=POLICY_LOSSES.config(spec)(name=spec))  # the module imported by the lookup
    loss, m, grad = run(spec)
    assert loss == pytest.approx((-1.5 - 0.5 - 1.0 + 2.2 + 1.4) / 5)
    assert m["pg_clipfrac"] == 0.0
    assert torch.allclose(grad, torch.tensor([[-1.5, -0.5, -1.0], [2.2, 1.4, 0.0]], dtype=torch.float64) / 5)
    with pytest.raises(ValueError, match="registered no policy loss named 'nope'"):
        AlgorithmConfig(policy_loss=VanillaConfig(name="tests.trainers.plugin_policy_loss:nope"))


def test_a_plugin_from_outside_declares_its_own_setting_and_the_config_tree_carries_it():
    """``unclipped``'s ``scale``, set as a user would (dotted overrides), reaches the trainer's loss call."""
    spec = "tests.trainers.plugin_policy_loss:unclipped"
    algorithm = load_config(preset="tiny", overrides=[f"algorithm.policy_loss.name={spec}",
                                                      "algorithm.policy_loss.scale=2.5"]).algorithm
    assert type(algorithm.policy_loss).__name__ == "UnclippedConfig" and algorithm.policy_loss.scale == 2.5
    loss, _, grad = run(algorithm.policy_loss.name, algorithm.policy_loss)
    assert loss == pytest.approx(2.5 * (-1.5 - 0.5 - 1.0 + 2.2 + 1.4) / 5)
    assert torch.allclose(grad, 2.5 * torch.tensor([[-1.5, -0.5, -1.0], [2.2, 1.4, 0.0]], dtype=torch.float64) / 5)
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss\.scale must be > 0, got 0\.0 \[algorithm\.policy_loss"
                                         r"\.scale: unclipped: weight of the surrogate\]"):
        load_config(preset="tiny", overrides=[f"algorithm.policy_loss.name={spec}", "algorithm.policy_loss.scale=0"])
