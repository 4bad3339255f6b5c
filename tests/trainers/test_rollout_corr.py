"""old_log_probs sources (recompute, skipped forward, bypass_mode) and the rollout_corr/* mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from common import schema
from common.models import ModelConfig, load_model
from tests.trainers._trainer_batches import make_batch, single_rank_group, with_training_fields
from trainers import fsdp
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.policy_losses import POLICY_LOSSES
from trainers.rollout_corr import MismatchSums, can_skip_old_forward, is_on_policy, resolve_bypass_mode
from trainers.update import StepSums, actor_step, filler_sample
from trainers.worker import TrainerWorker

TINY = ModelConfig(path="tiny")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from single_rank_group()


def make_worker(algorithm: AlgorithmConfig | None = None, **trainer) -> TrainerWorker:
    cfg = {"ppo_mini_batch_size": 2, "ppo_micro_batch_size": 8, "lr": 1e-3, "num_threads": 1} | trainer
    return TrainerWorker(TrainerConfig(**cfg), algorithm or AlgorithmConfig(), TINY, temperature=0.7,
                         max_response_length=5)


def _tags(versions: list[tuple[int, int]]) -> list[dict]:
    return [{schema.MIN_WEIGHT_VERSION: lo, schema.MAX_WEIGHT_VERSION: hi} for lo, hi in versions]


def test_skip_only_when_provably_equal():
    assert is_on_policy(_tags([(3, 3), (3, 3)]), 3)
    assert not is_on_policy(_tags([(3, 3), (2, 3)]), 3)  # a partial rollout across an update
    assert not is_on_policy(_tags([(2, 2)]), 3)  # one version stale
    plain = AlgorithmConfig()
    assert can_skip_old_forward(plain, ppo_epochs=1, num_mini_batches=1, on_policy=True)
    assert not can_skip_old_forward(plain, ppo_epochs=1, num_mini_batches=1, on_policy=False)
    assert not can_skip_old_forward(plain, ppo_epochs=2, num_mini_batches=1, on_policy=True)
    assert not can_skip_old_forward(plain, ppo_epochs=1, num_mini_batches=2, on_policy=True)
    kl_in_reward = AlgorithmConfig(use_kl_in_reward=True)  # reads old_log_probs before the update
    assert not can_skip_old_forward(kl_in_reward, ppo_epochs=1, num_mini_batches=1, on_policy=True)
    assert not can_skip_old_forward(AlgorithmConfig(bypass_mode=True), ppo_epochs=1, num_mini_batches=1,
                                    on_policy=True)


def test_bypass_mode_unset_is_chosen_per_mode_and_a_set_value_is_kept():
    """Unset: the rollers' log-probs exactly where trained samples can be stale and no stale_correction
    needs the trainer's; the whole config tree carries the choice (what show-config prints)."""
    from controller.config import load_config
    from controller.schedules import SCHEDULES

    def resolve(mode: str, algorithm: AlgorithmConfig) -> bool:
        return resolve_bypass_mode(SCHEDULES.get(mode).can_be_stale(algorithm), algorithm)

    unset = AlgorithmConfig()
    assert [resolve(m, unset) for m in ("sync", "one-step-off", "fully-async")] == [False, True, True]
    assert not resolve("fully-async", AlgorithmConfig(max_staleness=0))  # trains as sync
    assert not resolve("one-step-off", AlgorithmConfig(stale_correction="tis"))
    for mode in ("sync", "one-step-off", "fully-async"):
        for value in (True, False):
            assert resolve(mode, AlgorithmConfig(bypass_mode=value)) is value
    assert load_config(mode="fully-async").algorithm.bypass_mode is True
    assert load_config(mode="sync").algorithm.bypass_mode is False
    assert load_config(mode="one-step-off", overrides=["algorithm.bypass_mode=false"]).algorithm.bypass_mode is False
    assert load_config(mode="sync", overrides=["algorithm.bypass_mode=true"]).algorithm.bypass_mode is True


def test_bypass_mode_refuses_a_stale_correction():
    with pytest.raises(ValueError, match="algorithm.bypass_mode=true .* algorithm.stale_correction='tis'"):
        AlgorithmConfig(bypass_mode=True, stale_correction="tis")


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_skipped_forward_gives_the_same_loss_and_gradients_float64(policy_loss):
    """One mini-batch at the weights that generated it: old_log_probs taken from the training forward
    (detached) give the recomputed ones' loss and gradients (float64, so rounding is far below the bound)."""
    torch.manual_seed(0)
    policy = load_model(TINY).double()
    algorithm = AlgorithmConfig(policy_loss=POLICY_LOSSES.config(policy_loss)(name=policy_loss))
    batch = make_batch(num_groups=2, n=3, seed=5)
    batch[schema.ADVANTAGES] = torch.randn(batch[schema.RESPONSES].shape, dtype=torch.float64)
    with torch.no_grad():
        batch[schema.OLD_LOG_PROBS] = fsdp.response_log_probs(policy, batch, 0.7)[0]
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # the step leaves the weights as they are
    results = []
    for old_from_current in (False, True):
        sums = StepSums()
        actor_step(policy, optimizer, batch, filler_sample(batch), sums, algorithm=algorithm, temperature=0.7,
                   micro_batch_size=4, max_grad_norm=1e9, norm_length=5, old_from_current=old_from_current)
        grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
        results.append((sums.finish("actor"), grads))
    (recomputed, grads_recomputed), (skipped, grads_skipped) = results
    assert recomputed["actor/pg_loss"] != 0.0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ratio_mean", "actor/pg_clipfrac"):
        assert skipped[key] == pytest.approx(recomputed[key], rel=1e-10, abs=1e-12), key
    assert grads_skipped.keys() == grads_recomputed.keys() and grads_skipped
    for name, grad in grads_recomputed.items():
        torch.testing.assert_close(grads_skipped[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_worker_skips_the_forward_only_on_policy():
    worker = make_worker(ppo_mini_batch_size=2)
    batch = make_batch(num_groups=2, n=2, seed=6)
    batch[schema.ROLLOUT_LOG_PROBS] = torch.zeros(batch[schema.RESPONSES].shape)
    fresh = dict(batch)
    skip, metrics = worker._old_log_probs(fresh, _tags([(0, 0)] * 4), num_mini_batches=1)
    assert skip and schema.OLD_LOG_PROBS not in fresh and metrics["actor/old_log_prob_recomputed"] == 0.0
    stale = dict(batch)
    skip, metrics = worker._old_log_probs(stale, _tags([(0, 0)] * 3 + [(0, 1)]), num_mini_batches=1)
    assert not skip and schema.OLD_LOG_PROBS in stale and metrics["actor/old_log_prob_recomputed"] == 1.0
    two_minis = dict(batch)
    skip, _ = worker._old_log_probs(two_minis, _tags([(0, 0)] * 4), num_mini_batches=2)
    assert not skip and schema.OLD_LOG_PROBS in two_minis


def test_old_from_current_refuses_more_than_one_mini_batch():
    worker = make_worker(ppo_mini_batch_size=1)
    batch = with_training_fields(worker, make_batch(num_groups=2, seed=7))
    with pytest.raises(ValueError, match="one epoch of one mini-batch"):
        worker.update_actor(batch, old_from_current=True)


def test_bypass_mode_uses_rollout_log_probs():
    worker = make_worker(AlgorithmConfig(bypass_mode=True))
    batch = make_batch(num_groups=2, n=2, seed=8)
    rollout = -torch.rand(batch[schema.RESPONSES].shape)
    batch[schema.ROLLOUT_LOG_PROBS] = rollout
    skip, metrics = worker._old_log_probs(batch, _tags([(0, 0)] * 4), num_mini_batches=1)
    assert not skip and metrics["actor/old_log_prob_recomputed"] == 0.0
    assert torch.equal(batch[schema.OLD_LOG_PROBS], rollout)


def test_mismatch_metrics_from_recomputed_and_skipped_log_probs():
    worker = make_worker()
    batch = with_training_fields(worker, make_batch(num_groups=2, n=2, seed=9))
    mask = batch[schema.RESPONSE_MASK].bool()
    shift = 0.1  # the rollout engine gave every token 0.1 nats less than the trainer
    batch[schema.ROLLOUT_LOG_PROBS] = batch[schema.OLD_LOG_PROBS] - shift
    recomputed = worker.update_actor(dict(batch))
    assert recomputed["rollout_corr/kl"] == pytest.approx(-shift, abs=1e-6)
    assert recomputed["rollout_corr/k3_kl"] == pytest.approx(math.exp(shift) - 1 - shift, abs=1e-6)
    assert recomputed["rollout_corr/max_abs_diff"] == pytest.approx(shift, abs=1e-6)
    assert recomputed["rollout_corr/num_tokens"] == mask.sum().item()
    fresh = make_worker()  # same initial weights: the skipped forward measures the same mismatch
    skipped = fresh.update_actor({k: v for k, v in batch.items() if k != schema.OLD_LOG_PROBS},
                                 old_from_current=True)
    for key in ("rollout_corr/kl", "rollout_corr/max_abs_diff"):
        assert skipped[key] == pytest.approx(recomputed[key], abs=1e-5), key
    assert skipped["actor/ratio_mean"] == 1.0 and skipped["actor/pg_clipfrac"] == 0.0


def test_mismatch_sums_check_shapes():
    with pytest.raises(ValueError, match="same shape"):
        MismatchSums().add(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
