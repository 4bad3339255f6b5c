"""TrainerWorker in one process (a 1-rank gloo group): log-probs, PPO update invariants, weights access."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common import schema
from common.core_lending import BusyFlag
from common.models import ModelConfig
from tests.trainers._trainer_batches import (
    LINEAR_ADAM_LR,
    assert_same_updates,
    linear_adam,
    make_batch,
    single_rank_group,
    with_training_fields,
)
from trainers import fsdp
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.policy_losses import PolicyLossConfig
from trainers.worker import TrainerWorker, lr_factor

TINY = ModelConfig(path="tiny")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from single_rank_group()


def make_worker(**trainer_overrides) -> TrainerWorker:
    algorithm = trainer_overrides.pop("algorithm", AlgorithmConfig())
    cfg = {"ppo_mini_batch_size": 2, "ppo_micro_batch_size": 8, "lr": 1e-3, "num_threads": 1}
    cfg.update(trainer_overrides)
    return TrainerWorker(TrainerConfig(**cfg), algorithm, TINY, temperature=0.7, max_response_length=5)


def test_left_pads_do_not_change_log_probs():
    worker = make_worker()
    prompt = torch.tensor([[5, 7, 8, 11, 12]])
    responses = torch.tensor([[13, 14, 15, 2]])
    base = {schema.RESPONSES: responses, schema.RESPONSE_MASK: torch.ones_like(responses)}
    plain = {**base, schema.INPUT_IDS: prompt, schema.ATTENTION_MASK: torch.ones_like(prompt)}
    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    padded = {**base, schema.INPUT_IDS: padded_ids, schema.ATTENTION_MASK: (padded_ids != 0).long()}
    lp_plain = worker.compute_log_prob(plain)[schema.OLD_LOG_PROBS]
    lp_padded = worker.compute_log_prob(padded)[schema.OLD_LOG_PROBS]
    assert lp_plain.shape == (1, 4)
    assert torch.isfinite(lp_plain).all() and (lp_plain < 0).all()
    torch.testing.assert_close(lp_padded, lp_plain, atol=1e-5, rtol=0)


def test_log_probs_use_temperature():
    worker = make_worker()
    batch = make_batch(num_groups=1, n=2)
    at_07 = worker.compute_log_prob(batch)[schema.OLD_LOG_PROBS]
    worker.temperature = 1.0
    at_1 = worker.compute_log_prob(batch)[schema.OLD_LOG_PROBS]
    assert not torch.allclose(at_07, at_1)
    # Same convention as the rollers: log softmax(logits / T) at the sampled token.
    ids = torch.cat([batch[schema.INPUT_IDS], batch[schema.RESPONSES]], dim=1)
    mask = torch.cat([batch[schema.ATTENTION_MASK], torch.ones_like(batch[schema.RESPONSES])], dim=1)
    with torch.no_grad():
        logits = worker.policy(input_ids=ids, attention_mask=mask,
                               position_ids=fsdp.position_ids_from_mask(mask)).logits
    fsdp.reshard(worker.policy)
    resp_len = batch[schema.RESPONSES].shape[1]
    expected = torch.log_softmax(logits[:, -resp_len - 1 : -1] / 0.7, dim=-1)
    expected = expected.gather(-1, batch[schema.RESPONSES].unsqueeze(-1)).squeeze(-1)
    valid = batch[schema.RESPONSE_MASK].bool()  # trailing padding only: after it nothing is computed, 0
    torch.testing.assert_close(at_07[valid], expected[valid], atol=1e-5, rtol=0)
    assert at_07[~valid].eq(0).all()


def test_step0_ratio_is_one_and_nothing_clipped():
    worker = make_worker()
    batch = with_training_fields(worker, make_batch(seed=1))
    mask = batch[schema.RESPONSE_MASK].bool()
    # The training forward (with grad) reproduces old_log_probs: ratio exp(new - old) = 1 on every valid token.
    new, _ = fsdp.response_log_probs(worker.policy, batch, worker.temperature)
    ratio = torch.exp(new.detach() - batch[schema.OLD_LOG_PROBS])[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0)
    metrics = worker.update_actor(batch)  # one mini-batch: the step runs at unchanged weights
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["actor/num_tokens"] == mask.sum().item()
    valid_adv = batch[schema.ADVANTAGES][mask]
    assert metrics["actor/advantages/mean"] == pytest.approx(valid_adv.double().mean().item(), abs=1e-6)
    assert metrics["actor/advantages/max"] == pytest.approx(valid_adv.max().item())
    assert worker.get_weight_version() == 1


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("split", [{"ppo_micro_batch_size": 1}, {"ppo_max_token_len_per_gpu": 24}],
                         ids=["8x1", "token-budget"])
def test_gradient_accumulation_1x8_equals_8x1(mode, split):
    """One micro-batch of 8 equals eight of one, and equals micro-batches cut by a token budget (verl's
    dynamic batch size: here 24 tokens, two to four samples of up to 11 tokens per pass)."""
    algorithm = AlgorithmConfig(loss_agg_mode=mode)
    one = make_worker(ppo_micro_batch_size=8, algorithm=algorithm, lr=LINEAR_ADAM_LR)
    eight = make_worker(**split, algorithm=algorithm, lr=LINEAR_ADAM_LR)
    linear_adam(one), linear_adam(eight)
    batch = with_training_fields(one, make_batch(seed=2))
    before = one.full_state_dict()
    m_one, m_eight = one.update_actor(batch), eight.update_actor(batch)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m_eight[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-6), key
    # One mini-batch: the gradients that reached the optimizer are the whole batch's, at the same weights.
    for (name, p_one), (_, p_eight) in zip(one.policy.named_parameters(), eight.policy.named_parameters(), strict=True):
        g_one, g_eight = p_one.grad.full_tensor(), p_eight.grad.full_tensor()
        torch.testing.assert_close(g_eight, g_one, atol=1e-5 * g_one.abs().max().item(), rtol=1e-4, msg=name)
    assert_same_updates(before, one.full_state_dict(), before, eight.full_state_dict())


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_one_rank_reduces_gradients_once_per_update(monkeypatch, compute_dtype):
    """On a one-rank group FSDP reduces each parameter group's gradients once per optimizer step, after the
    last micro-batch, not once per micro-batch; the gradients that reach the optimizer are still the whole
    batch's (float32 master gradients, accumulated in float32 under bf16 compute), and the next update
    reduces again."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    reduces = []
    real = _fsdp_param_group.foreach_reduce
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", lambda *a, **k: reduces.append(1) or real(*a, **k))
    model = ModelConfig(path="tiny", compute_dtype=compute_dtype)
    cfg = {"ppo_mini_batch_size": 2, "lr": 1e-3, "num_threads": 1}
    one, eight = (TrainerWorker(TrainerConfig(ppo_micro_batch_size=m, **cfg), AlgorithmConfig(), model,
                                temperature=0.7, max_response_length=5) for m in (8, 1))
    batch = with_training_fields(one, make_batch(seed=2))
    units = len(fsdp.fsdp_modules(eight.policy))
    one.update_actor(batch)
    reduces.clear()
    eight.update_actor(batch)
    assert len(reduces) == units  # 8 micro-batches; before: 8 × units
    tolerance = 1e-5 if compute_dtype == "float32" else 2e-2  # bf16: each micro-batch's gradient rounds alone
    for (name, p_one), (_, p_eight) in zip(one.policy.named_parameters(), eight.policy.named_parameters(), strict=True):
        g_one, g_eight = p_one.grad.full_tensor(), p_eight.grad.full_tensor()
        assert g_eight.dtype == torch.float32, name
        torch.testing.assert_close(g_eight, g_one, atol=tolerance * g_one.abs().max().item(), rtol=0, msg=name)
    eight.update_actor(batch)
    assert len(reduces) == 2 * units


def _more_padding(batch: dict, left: int = 3, right: int = 6) -> dict:
    """``batch`` with ``left`` more prompt pad columns and ``right`` more response pad columns (0 in every
    field): padding that no sample needs, as a long-tail batch's short samples carry."""
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            prompt = key in (schema.INPUT_IDS, schema.ATTENTION_MASK)
            out[key] = F.pad(value, (left, 0) if prompt else (0, right))
    return out


def _sequence_widths(batch: dict, micro: int) -> list[int]:
    """What each micro-batch should be cut to: samples sorted by real prompt tokens + response extent,
    ``micro`` at a time, each as wide as its longest real prompt plus its longest response."""
    prompt = batch[schema.ATTENTION_MASK].sum(1).tolist()
    extent = [int(row.nonzero().max()) + 1 for row in batch[schema.RESPONSE_MASK]]
    order = sorted(range(len(prompt)), key=lambda i: prompt[i] + extent[i])
    chunks = [order[i : i + micro] for i in range(0, len(order), micro)]
    return [max(prompt[i] for i in c) + max(extent[i] for i in c) for c in chunks]


def _log_probs_and_shapes(worker, batch: dict) -> tuple[dict, list[tuple[int, int]]]:
    """``worker.compute_log_prob(batch)`` and the ``(rows, width)`` of each forward's ``input_ids``."""
    shapes: list[tuple[int, int]] = []
    hook = worker.policy.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        return worker.compute_log_prob(batch), shapes
    finally:
        hook.remove()


def test_micro_batches_are_cut_to_their_own_longest_sample():
    """One row per sample (``prefix_grouper`` off; the shared-prompt rows: tests/trainers/test_prefix_grouper.py)."""
    batch = make_batch(num_groups=2, n=4, prompt_len=6, response_len=5, seed=5)
    padded = _more_padding(batch)
    out, shapes = _log_probs_and_shapes(make_worker(ppo_micro_batch_size=3, prefix_grouper=False), padded)
    widths = [width for _, width in shapes]
    # The model never sees the 9 extra columns, nor the padding a batch-wide width would add.
    assert widths == _sequence_widths(batch, 3)
    assert sum(widths) < 3 * (padded[schema.INPUT_IDS].shape[1] + padded[schema.RESPONSES].shape[1])
    by_tokens, shapes = _log_probs_and_shapes(make_worker(ppo_micro_batch_size=8, ppo_max_token_len_per_gpu=24,
                                                          prefix_grouper=False), padded)
    rows = [r for r, _ in shapes]
    assert sum(rows) == 8 and len(rows) > 1  # a token budget cuts the same samples into more passes
    assert all(r * w <= 24 for r, w in shapes if r > 1)
    # Results come back in the batch's order, at its width, 0 on the cut columns: the same as one
    # untrimmed micro-batch of everything (here with shared prompts).
    reference = make_worker(ppo_micro_batch_size=8).compute_log_prob(batch)
    for key in (schema.OLD_LOG_PROBS, "entropy"):
        assert out[key].shape == padded[schema.RESPONSES].shape
        assert not out[key][:, 5:].any()
        mask = batch[schema.RESPONSE_MASK].bool()
        torch.testing.assert_close(out[key][:, :5][mask], reference[key][mask], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(by_tokens[key], out[key], atol=1e-5, rtol=0, msg=key)


def test_a_forward_without_response_mask_keeps_every_response_column():
    batch = make_batch(seed=7)
    worker = make_worker(ppo_micro_batch_size=3)
    with_mask = worker.compute_log_prob(batch)[schema.OLD_LOG_PROBS]
    without = {k: v for k, v in batch.items() if k != schema.RESPONSE_MASK}
    full = worker.compute_log_prob(without)[schema.OLD_LOG_PROBS]
    mask = batch[schema.RESPONSE_MASK].bool()
    assert full.shape == with_mask.shape and (full[~mask] != 0).all()  # padding positions computed too
    torch.testing.assert_close(full[mask], with_mask[mask], atol=1e-5, rtol=0)


def test_padding_no_sample_needs_changes_no_update():
    algorithm = AlgorithmConfig(entropy_coeff=0.01)
    plain = make_worker(ppo_micro_batch_size=3, algorithm=algorithm, lr=LINEAR_ADAM_LR)
    padded = make_worker(ppo_micro_batch_size=3, algorithm=algorithm, lr=LINEAR_ADAM_LR)
    linear_adam(plain), linear_adam(padded)
    batch = with_training_fields(plain, make_batch(seed=6))
    before = plain.full_state_dict()
    m_plain, m_padded = plain.update_actor(batch), padded.update_actor(_more_padding(batch))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/num_tokens"):
        assert m_padded[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-6), key
    assert_same_updates(before, plain.full_state_dict(), before, padded.full_state_dict())


def test_every_trainable_parameter_changes():
    worker = make_worker()
    before = worker.full_state_dict()
    batch = with_training_fields(worker, make_batch(seed=3))
    metrics = worker.update_actor(batch)
    after = worker.full_state_dict()
    trainable = [name for name, p in worker.policy.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(before)
    unchanged = [name for name in trainable if torch.equal(before[name], after[name])]
    assert not unchanged
    assert metrics["actor/skipped_steps"] == 0.0 and math.isfinite(metrics["actor/grad_norm"])


def _optimizer_state(worker) -> dict[str, torch.Tensor]:
    out = {}
    for i, state in enumerate(worker.actor_optimizer.state.values()):
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"{i}.{key}"] = local.clone()
    return out


def test_all_masked_completions_give_zero_loss_and_leave_optimizer_alone():
    worker = make_worker(algorithm=AlgorithmConfig(entropy_coeff=0.01))
    batch = with_training_fields(worker, make_batch(seed=4))
    worker.update_actor(batch)  # a normal step first, so the optimizer has state to protect
    state_before, weights_before = _optimizer_state(worker), worker.full_state_dict()
    masked = {**batch, schema.RESPONSE_MASK: torch.zeros_like(batch[schema.RESPONSE_MASK])}
    metrics = worker.update_actor(masked)
    assert metrics["actor/pg_loss"] == 0.0
    assert metrics["actor/num_tokens"] == 0.0 and metrics["actor/skipped_steps"] == 1.0
    assert metrics["actor/grad_norm"] == 0.0
    for name, p in worker.policy.named_parameters():
        grad = p.grad.to_local()
        assert torch.isfinite(grad).all() and not grad.any(), name
    state_after = _optimizer_state(worker)
    for key, value in state_before.items():
        assert torch.isfinite(state_after[key]).all() and torch.equal(state_after[key], value), key
    for name, tensor in worker.full_state_dict().items():
        assert torch.equal(tensor, weights_before[name]), name
    later = worker.update_actor(batch)  # and training goes on normally
    assert later["actor/skipped_steps"] == 0.0 and math.isfinite(later["actor/pg_loss"])
    assert all(torch.isfinite(t).all() for t in worker.full_state_dict().values())


def test_missing_field_is_a_clear_error():
    worker = make_worker()
    batch = make_batch()
    with pytest.raises(ValueError, match="old_log_probs"):
        worker.update_actor(batch)
    with pytest.raises(RuntimeError, match="critic"):
        worker.compute_values(batch)


def test_local_shards_cover_full_tensors_on_one_rank():
    worker = make_worker()
    full = worker.full_state_dict()
    shards = list(worker.named_local_shards())
    assert [s.name for s in shards] == list(full)
    assert "lm_head.weight" not in full  # tied to model.embed_tokens.weight, listed once
    for shard in shards:
        assert shard.row_offset == 0 and shard.full_shape == tuple(full[shard.name].shape)
        assert torch.equal(shard.tensor, full[shard.name])


def test_critic_values_and_update():
    algorithm = AlgorithmConfig(adv_estimator="gae", norm_adv_by_std=False)
    worker = make_worker(algorithm=algorithm, critic_lr=3e-3)
    batch = make_batch(seed=5)
    batch.update(worker.compute_log_prob(batch))
    values = worker.compute_values(batch)[schema.VALUES]
    assert values.shape == batch[schema.RESPONSES].shape and not values.any()  # zero-initialised head
    batch[schema.VALUES] = values
    batch.update(worker.compute_advantages(batch)[0])
    losses = []
    for _ in range(3):
        losses.append(worker.update_critic(batch)["critic/vf_loss"])
        batch[schema.VALUES] = worker.compute_values(batch)[schema.VALUES]
    assert losses[-1] < losses[0]


def test_tensordict_batches_are_accepted():
    from tensordict import TensorDict

    worker = make_worker()
    batch = make_batch(num_groups=1, n=2)
    uid = batch.pop(schema.UID)
    td = TensorDict(batch, batch_size=[2])
    td.set_non_tensor(schema.UID, uid)
    out = worker.compute_log_prob(td)
    torch.testing.assert_close(out[schema.OLD_LOG_PROBS], worker.compute_log_prob(batch)[schema.OLD_LOG_PROBS])
    fields, _ = worker.compute_advantages({**td.to_dict(), schema.UID: uid})
    assert fields[schema.ADVANTAGES].shape == batch[schema.RESPONSES].shape


def test_lr_schedule():
    assert lr_factor(0, schedule="constant", warmup_steps=4, total_steps=10) == 0.25
    assert lr_factor(5, schedule="constant", warmup_steps=4, total_steps=10) == 1.0
    assert lr_factor(2, schedule="cosine", warmup_steps=2, total_steps=10) == 1.0
    assert lr_factor(6, schedule="cosine", warmup_steps=2, total_steps=10) == pytest.approx(0.5)
    assert lr_factor(10, schedule="cosine", warmup_steps=2, total_steps=10) == pytest.approx(0.0)


def test_overlong_penalty_shapes_token_level_rewards():
    # max_response_length=5, buffer 2: lengths <= 3 untouched, 4 -> -0.5, 5 -> -1 (times the factor 0.5).
    algorithm = AlgorithmConfig(overlong_buffer_len=2, overlong_penalty_factor=0.5)
    worker = make_worker(algorithm=algorithm)
    batch = make_batch(seed=3)
    fields, metrics = worker.compute_advantages(batch)
    lengths = batch[schema.RESPONSE_MASK].sum(-1)
    expected = (3.0 - lengths.float()).div(2).clamp(-1, 0) * 0.5
    shift = fields[schema.TOKEN_LEVEL_REWARDS].sum(-1) - batch[schema.TOKEN_LEVEL_SCORES].sum(-1)
    torch.testing.assert_close(shift, expected)
    assert (expected < 0).any() and (expected == 0).any()  # the batch has lengths on both sides
    assert metrics["overlong/penalty_mean"] == pytest.approx(expected.mean().item())
    assert metrics["overlong/frac_penalised"] == pytest.approx((expected < 0).float().mean().item())
    plain, plain_metrics = make_worker().compute_advantages(batch)
    torch.testing.assert_close(plain[schema.TOKEN_LEVEL_REWARDS], batch[schema.TOKEN_LEVEL_SCORES])
    assert not any(k.startswith("overlong/") for k in plain_metrics)


def test_overlong_buffer_longer_than_responses_is_rejected():
    with pytest.raises(ValueError, match="algorithm.overlong_buffer_len=6"):
        make_worker(algorithm=AlgorithmConfig(overlong_buffer_len=6))


def test_policy_loss_selector_reaches_the_actor_loss():
    # GPG's loss is -A log pi (no ratio): at step 0 the training forward reproduces old_log_probs, so the
    # logged pg_loss is the token mean of -A * old_log_probs (vanilla would log -mean(A) at ratio 1).
    worker = make_worker(algorithm=AlgorithmConfig(adv_estimator="gpg", policy_loss=PolicyLossConfig(name="gpg")))
    batch = with_training_fields(worker, make_batch(seed=1))
    mask = batch[schema.RESPONSE_MASK].bool()
    expected = -(batch[schema.ADVANTAGES] * batch[schema.OLD_LOG_PROBS])[mask].double().mean().item()
    assert expected != pytest.approx(-batch[schema.ADVANTAGES][mask].double().mean().item(), abs=1e-3)
    metrics = worker.update_actor(batch)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-5)


def test_the_worker_asks_the_estimator_plugin():
    remax = make_worker(algorithm=AlgorithmConfig(adv_estimator="remax"))
    assert remax.critic is None and remax.estimator.roller_extras == (schema.REMAX_BASELINE,)
    with pytest.raises(ValueError, match="compute_advantages needs batch fields \\['remax_baseline'\\]"):
        remax.compute_advantages(make_batch(seed=4))
    # A plug-in from outside the package, by module:name: s_i - max(s_group) on every valid token.
    worker = make_worker(algorithm=AlgorithmConfig(adv_estimator="tests.trainers.plugin_estimator:group_max_baseline"))
    batch = make_batch(seed=4)
    fields, _ = worker.compute_advantages(batch)
    scores = batch[schema.TOKEN_LEVEL_SCORES].sum(-1)
    best = torch.stack([scores[i // 4 * 4 : i // 4 * 4 + 4].max() for i in range(len(scores))])
    expected = (scores - best).unsqueeze(-1) * batch[schema.RESPONSE_MASK]
    torch.testing.assert_close(fields[schema.ADVANTAGES], expected)


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights():
    """model.compute_dtype=bfloat16 (FSDP2 MixedPrecisionPolicy): log-probs are the fp32 model's up to bf16
    rounding (not equal: the forward really ran in bf16), and parameters, gradients and optimizer state stay
    float32; a step changes every parameter."""
    full = make_worker()
    mixed = TrainerWorker(TrainerConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=8, lr=1e-3, num_threads=1),
                          AlgorithmConfig(), ModelConfig(path="tiny", compute_dtype="bfloat16"), temperature=0.7,
                          max_response_length=5)
    batch = make_batch(seed=4)
    lp_full = full.compute_log_prob(batch)[schema.OLD_LOG_PROBS]
    lp_mixed = mixed.compute_log_prob(batch)[schema.OLD_LOG_PROBS]
    assert lp_mixed.dtype == torch.float32 and not torch.equal(lp_mixed, lp_full)
    torch.testing.assert_close(lp_mixed, lp_full, atol=0.1, rtol=0)  # bf16 keeps ~3 significant digits
    before = mixed.full_state_dict()
    assert all(t.dtype == torch.float32 for t in before.values())
    metrics = mixed.update_actor(with_training_fields(mixed, batch))
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/skipped_steps"] == 0.0
    after = mixed.full_state_dict()
    assert all(t.dtype == torch.float32 for t in after.values())
    assert [n for n in before if torch.equal(before[n], after[n])] == []
    state = _optimizer_state(mixed)
    assert state and all(t.dtype == torch.float32 for t in state.values())


def test_core_lending_decides_per_decoder_layer_in_forward_and_backward(tmp_path):
    """With ``core_lending_dir`` the trainer re-decides its threads before every decoder layer's forward and
    backward (``common.core_lending``), through FSDP2's hooks; a busy roller's threads are taken off."""
    BusyFlag(tmp_path, "roller0", 1).set(True)
    before = torch.get_num_threads()
    try:
        worker = TrainerWorker(TrainerConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=8, lr=1e-3, num_threads=2),
                               AlgorithmConfig(), TINY, temperature=0.7, max_response_length=5,
                               core_lending_dir=str(tmp_path))
        calls = {"forward": 0, "backward": 0}
        apply = worker.core_lender.apply

        def counted():
            calls["forward" if torch.is_grad_enabled() else "backward"] += 1
            return apply()

        worker.core_lender.apply = counted
        batch = with_training_fields(worker, make_batch(seed=5))
        calls.update(forward=0, backward=0)
        metrics = worker.update_actor(batch)
        layers = len(fsdp.decoder_layers(worker.policy))
        assert layers >= 2 and metrics["actor/skipped_steps"] == 0.0
        assert calls["forward"] >= layers + 1 and calls["backward"] >= layers, calls
        assert worker.core_lender.current == 1  # 2 planned - 1 decoding
    finally:
        torch.set_num_threads(before)
