"""Advantage-estimator plug-ins: the estimators verl users bring (hand-computed), the wiring each carries,
and an estimator from outside the package selected as ``module:name``."""

from __future__ import annotations

import pytest
import torch

from common import schema
from trainers.advantages import ADV_ESTIMATORS, compute_advantages
from trainers.config import AlgorithmConfig

PLUGIN = "tests.trainers.plugin_estimator:group_max_baseline"


def outcome(scores, lengths, response_len=4):
    """Rewards with each score on the last valid token, and the mask; float64."""
    mask = (torch.arange(response_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    rewards = torch.zeros(len(scores), response_len, dtype=torch.float64)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, mask


def per_sample(adv, mask):
    """The one advantage of each sample (all its valid tokens carry it; padding is 0)."""
    assert torch.equal(adv[~mask.bool()], torch.zeros_like(adv[~mask.bool()]))
    return adv[:, 0]


def test_grpo_passk_only_the_best_sample_gets_the_gap():
    # Group a: [1, 0.5, 0] -> best gets 1 - 0.5 = 0.5, divided by std = 0.5 (Bessel) -> 1.0 (eps 1e-6).
    # Group b: [1, 1] ties -> gap 0. Group c: one sample -> 0.
    rewards, mask = outcome([1.0, 0.5, 0.0, 1.0, 1.0, 3.0], [4, 2, 3, 1, 4, 2])
    uid = ["a", "a", "a", "b", "b", "c"]
    adv, ret = compute_advantages("grpo_passk", token_level_rewards=rewards, response_mask=mask, uid=uid)
    expected = torch.tensor([0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0], dtype=torch.float64)
    assert torch.allclose(per_sample(adv, mask), expected) and torch.equal(ret, adv)
    raw, _ = compute_advantages("grpo_passk", token_level_rewards=rewards, response_mask=mask, uid=uid,
                                norm_adv_by_std=False)
    assert torch.allclose(per_sample(raw, mask), torch.tensor([0.5, 0, 0, 0, 0, 0], dtype=torch.float64))


def test_opo_subtracts_the_length_weighted_mean():
    # Group a: scores [1, 0, 1], lengths [4, 2, 1]: b = (4*1 + 2*0 + 1*1) / 7 = 5/7.
    # Group b: scores [0, 1], lengths [3, 1]: b = 1/4. Group c: one sample -> 0.
    rewards, mask = outcome([1.0, 0.0, 1.0, 0.0, 1.0, 2.0], [4, 2, 1, 3, 1, 2])
    uid = ["a", "a", "a", "b", "b", "c"]
    adv, _ = compute_advantages("opo", token_level_rewards=rewards, response_mask=mask, uid=uid)
    expected = torch.tensor([2 / 7, -5 / 7, 2 / 7, -0.25, 0.75, 0.0], dtype=torch.float64)
    assert torch.allclose(per_sample(adv, mask), expected)


def test_gpg_scales_the_centred_score_by_batch_over_nonzero():
    # B = 6 samples, 3 with a non-zero score -> alpha = 2. Group a [1, 0, 0] mean 1/3; b [1, 0] mean 1/2;
    # c [2] alone -> 0.
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0, 0.0, 2.0], [4, 2, 1, 3, 1, 2])
    uid = ["a", "a", "a", "b", "b", "c"]
    adv, _ = compute_advantages("gpg", token_level_rewards=rewards, response_mask=mask, uid=uid)
    expected = 2 * torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.5, -0.5, 0.0], dtype=torch.float64)
    assert torch.allclose(per_sample(adv, mask), expected)


def test_each_estimator_carries_its_wiring():
    assert ADV_ESTIMATORS.get("gae").needs_critic and ADV_ESTIMATORS.get("gae").input_fields == (schema.VALUES,)
    assert ADV_ESTIMATORS.get("remax").roller_extras == (schema.REMAX_BASELINE,)
    assert ADV_ESTIMATORS.get("remax").input_fields == (schema.REMAX_BASELINE,)
    for name in ("grpo", "grpo_passk", "opo", "gpg"):
        plugin = ADV_ESTIMATORS.get(name)
        assert not plugin.needs_critic and plugin.input_fields == (schema.UID,) and plugin.roller_extras == ()
    # Group-local: a sample's advantage needs only its own uid group (the trainer then skips the gather).
    local = {name for name in ADV_ESTIMATORS if ADV_ESTIMATORS.get(name).group_local}
    assert {"grpo", "drgrpo", "rloo", "grpo_passk", "opo", "remax"} <= local
    assert not local & {"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg"}  # batch statistics


def test_a_plugin_from_outside_is_selected_as_module_colon_name():
    cfg = AlgorithmConfig(adv_estimator=PLUGIN)  # validation imports the module, which registers it
    assert ADV_ESTIMATORS.get(cfg.adv_estimator).name == "group_max_baseline"
    rewards, mask = outcome([1.0, 0.25, 0.0, 2.0], [4, 2, 1, 3])
    adv, _ = compute_advantages(PLUGIN, token_level_rewards=rewards, response_mask=mask, uid=["a", "a", "b", "b"])
    # Group a: max 1 -> [0, -0.75]; group b: max 2 -> [-2, 0].
    assert torch.allclose(per_sample(adv, mask), torch.tensor([0.0, -0.75, -2.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="needs uid"):
        compute_advantages(PLUGIN, token_level_rewards=rewards, response_mask=mask)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("tests.trainers.no_such_module:x", r"algorithm\.adv_estimator='tests\.trainers\.no_such_module:x': "
                                            r"cannot import 'tests\.trainers\.no_such_module'"),
        ("tests.trainers.plugin_estimator:nope", r"registered no advantage estimator named 'nope'; "
                                                 r"registered: \[.*'grpo'"),
        (":x", "must look like 'module:name'"),
        ("ppo", r"algorithm\.adv_estimator='ppo' is not one of \[.*'gpg', .*'grpo', 'grpo_passk'"),
    ],
)
def test_unknown_estimators_list_the_registered_ones(spec, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(adv_estimator=spec)


def test_duplicate_registration_is_refused():
    from trainers.advantages import register_adv_estimator

    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_adv_estimator("grpo")(lambda token_level_rewards, response_mask: None)
    with pytest.raises(ValueError, match="declares input_fields"):
        register_adv_estimator("x_bad", input_fields=("values",))(lambda token_level_rewards, response_mask: None)
