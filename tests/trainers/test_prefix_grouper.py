"""``trainer.prefix_grouper``: a micro-batch's forward computes each prompt once for all its samples
(``trainers.batching.shared_prompt_layout``), and must give exactly what one row per sample gives: the
same log-probs, entropies, values and gradients on every token up to each sample's last valid one.

Float64 tiny model with small random weights: forward values agree to ~1e-12; gradients to fp32 rounding
(the trainer takes the softmax over fp32 logits), where a sample attending to the wrong tokens is off by ~0.1.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForTokenClassification

from common import schema
from common.models import ModelConfig, load_hf_config, load_model
from tests.trainers._trainer_batches import (
    float64_random,
    make_batch,
    single_rank_group,
    with_training_fields,
)
from tests.trainers.test_worker import make_worker
from trainers import batching
from trainers.batching import micro_batch_plan, prompt_groups, shared_prompt_layout
from trainers.fsdp import response_log_probs, response_values

TINY = ModelConfig(path="tiny")
PROMPTS = ([5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16])
# batch order interleaves the groups: prompt 0 ×3, prompt 1 ×1, prompt 2 ×2
GROUP_OF = (0, 1, 0, 2, 0, 2)
# model tokens 1, tool tokens 0 (interior zeros: context, not loss), trailing zeros padding; row 5: nothing
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0],
                     [1, 1, 1, 1, 1, 1, 1, 1],
                     [1, 0, 0, 0, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 1, 0, 0],
                     [1, 1, 1, 1, 1, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0]])
EXTENT = torch.tensor([6, 8, 1, 6, 5, 0])  # up to the last valid token


@pytest.fixture(scope="module")
def policy():
    return float64_random(load_model(TINY))


@pytest.fixture(scope="module")
def critic():
    config = load_hf_config(TINY)
    config.num_labels, config.classifier_dropout = 1, 0.0  # as the worker builds it (trainers.fsdp)
    return float64_random(AutoModelForTokenClassification.from_config(config))


def _batch(seed: int = 0) -> dict:
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(GROUP_OF), width), dtype=torch.int64)
    for row, group in enumerate(GROUP_OF):
        ids[row, width - len(PROMPTS[group]):] = torch.tensor(PROMPTS[group])
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(4, 50, MASK.shape, generator=gen)
    responses[torch.arange(MASK.shape[1])[None, :] >= EXTENT[:, None]] = 0  # trailing padding
    return {schema.INPUT_IDS: ids, schema.ATTENTION_MASK: (ids != 0).long(), schema.RESPONSES: responses,
            schema.RESPONSE_MASK: MASK}


def _within_extent() -> torch.Tensor:
    return torch.arange(MASK.shape[1])[None, :] < EXTENT[:, None]


def test_the_layout_holds_each_prompt_once():
    batch = _batch()
    assert prompt_groups(batch) == [[0, 2, 4], [1], [3, 5]]
    layout = shared_prompt_layout(batch)
    width_p = batch[schema.INPUT_IDS].shape[1]
    # one row per prompt, as wide as the prompt columns plus the longest row's responses (6+1+5, 8, 6+0)
    assert layout.input_ids.shape == (3, width_p + 12)
    assert layout.attention_mask.shape == (3, 1, width_p + 12, width_p + 12)
    assert torch.equal(layout.valid, _within_extent())
    # the forward sees 12 prompt tokens, not the batch's 26
    assert int(layout.input_ids[:, :width_p].ne(0).sum()) == sum(map(len, PROMPTS)) == 12
    assert int(batch[schema.ATTENTION_MASK].sum()) == 26
    # row 0: prompt 0 (left-padded), then sample 0's 6 tokens, sample 2's 1, sample 4's 5
    row = layout.input_ids[0, width_p:]
    responses = batch[schema.RESPONSES]
    assert row.tolist() == [*responses[0, :6].tolist(), *responses[2, :1].tolist(), *responses[4, :5].tolist()]
    assert layout.position_ids[0, width_p:].tolist() == [*range(5, 11), 5, *range(5, 10)]


def test_log_probs_and_entropy_equal_one_row_per_sample(policy):
    batch = _batch()
    with torch.no_grad():
        plain, plain_entropy = response_log_probs(policy, batch, 0.7, with_entropy=True)
        shared, shared_entropy = response_log_probs(policy, batch, 0.7, with_entropy=True, share_prompts=True)
    model = MASK.bool()  # model tokens; tool tokens and padding are context only
    torch.testing.assert_close(shared[model], plain[model], atol=1e-12, rtol=0)
    torch.testing.assert_close(shared_entropy[model], plain_entropy[model], atol=1e-12, rtol=0)
    assert plain[model].lt(0).all() and plain_entropy[model].gt(0).all()
    for values in (plain, plain_entropy, shared, shared_entropy):
        assert values[~model].eq(0).all()


@pytest.mark.parametrize("share", [False, True])
def test_the_output_head_runs_on_model_tokens_only(policy, share):
    rows: list[int] = []
    hook = policy.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
    try:
        with torch.no_grad():
            response_log_probs(policy, _batch(), 1.0, with_entropy=True, share_prompts=share)
    finally:
        hook.remove()
    assert rows == [int(MASK.sum())]  # 20 of the batch's 48 response positions (6 rows x 8)


def test_gradients_equal_one_row_per_sample(policy):
    batch = _batch(seed=1)
    weights = torch.randn(MASK.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * MASK

    def grads(share: bool) -> list[torch.Tensor]:
        policy.zero_grad(set_to_none=True)
        log_probs, entropy = response_log_probs(policy, batch, 1.0, with_entropy=True, entropy_grad=True,
                                                share_prompts=share)
        ((weights * log_probs).sum() + 0.1 * (entropy * MASK).sum()).backward()
        return [p.grad.clone() for p in policy.parameters()]

    plain, shared = grads(False), grads(True)
    assert any(g.abs().max() > 1e-3 for g in plain)
    for a, b in zip(plain, shared, strict=True):  # logits are cast to fp32 for the softmax: fp32 rounding
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_critic_values_equal_one_row_per_sample(critic):
    batch = _batch(seed=3)
    with torch.no_grad():
        plain, shared = response_values(critic, batch), response_values(critic, batch, share_prompts=True)
    inside = _within_extent()
    torch.testing.assert_close(shared[inside], plain[inside], atol=1e-12, rtol=0)
    assert shared[~inside].eq(0).all()


def test_one_samples_response_changes_no_other_sample(policy):
    batch, changed = _batch(), _batch()
    changed[schema.RESPONSES][0, :6] = torch.arange(20, 26)  # sample 0 shares its row with samples 2 and 4
    with torch.no_grad():
        before, _ = response_log_probs(policy, batch, 1.0, share_prompts=True)
        after, _ = response_log_probs(policy, changed, 1.0, share_prompts=True)
    assert not torch.equal(before[0], after[0])
    assert torch.equal(before[1:], after[1:])


def test_the_plan_keeps_a_prompts_samples_together_and_counts_shared_tokens():
    batch = _batch()
    # packed lengths: prompt 0: 5 + 12 = 17, prompt 1: 3 + 8 = 11, prompt 2: 4 + 6 = 10 -> shortest first
    order, slices = micro_batch_plan(batch, 8, share_prompts=True)
    assert order == [3, 5, 1, 0, 2, 4] and slices == [slice(0, 6)]
    # budget 32: [3, 5] (1 row x (4 + 6)); + sample 1 would be 2 rows x (4 + 8) = 24; + sample 0: 3 rows x
    # (5 + 8) = 39 > 32, so it starts the next pass: [0, 2, 4] = 1 row x (5 + 12) = 17
    _, by_tokens = micro_batch_plan(batch, 8, 32, share_prompts=True)
    assert by_tokens == [slice(0, 3), slice(3, 6)]
    _, by_count = micro_batch_plan(batch, 2, 0, share_prompts=True)
    assert by_count == [slice(0, 2), slice(2, 4), slice(4, 6)]


@pytest.fixture(scope="module")
def process_group():
    yield from single_rank_group()


def test_a_row_wider_than_the_cap_falls_back_to_one_row_per_sample(policy, monkeypatch):
    """Past ``SHARED_ROW_MAX_TOKENS`` a shared row's attention (width²) would cost more than the prompt tokens
    it saves: the forward takes one row per sample, with the same results, and the plan counts it that way."""
    batch = _batch(seed=6)
    assert shared_prompt_layout(batch) is not None  # widest row: 5 + 12 = 17 tokens
    monkeypatch.setattr(batching, "SHARED_ROW_MAX_TOKENS", 15)
    assert shared_prompt_layout(batch) is None
    shapes = []
    hook = policy.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        with torch.no_grad():
            fallback, _ = response_log_probs(policy, batch, 1.0, share_prompts=True)
            plain, _ = response_log_probs(policy, batch, 1.0)
    finally:
        hook.remove()
    assert shapes[0] == (6, 5 + 8)  # one row per sample: prompt columns + response columns
    inside = _within_extent()
    torch.testing.assert_close(fallback[inside], plain[inside], atol=1e-12, rtol=0)
    assert fallback[~inside].eq(0).all()
    # as in the plan test, until [0, 2, 4] would share one 17-token row: 3 samples x (5 + 6) = 33 > 32
    _, slices = micro_batch_plan(batch, 8, 32, share_prompts=True)
    assert slices == [slice(0, 3), slice(3, 5), slice(5, 6)]


def _forward_shapes(worker, fn):
    shapes: list[tuple[int, ...]] = []
    hook = worker.policy.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        return fn(), shapes
    finally:
        hook.remove()


def test_a_worker_step_with_shared_prompts_equals_one_without(process_group):
    """The FSDP2 worker end to end, micro-batches cut by a token budget: the same old log-probs, the same
    loss and gradient norm (both taken before the optimizer step), in fewer forward rows."""
    batch = make_batch(num_groups=2, n=4, prompt_len=6, response_len=5, seed=4)
    results, rows = {}, {}
    for share in (False, True):
        worker = make_worker(ppo_micro_batch_size=8, ppo_max_token_len_per_gpu=40, prefix_grouper=share)
        full = with_training_fields(worker, batch)
        metrics, shapes = _forward_shapes(worker, lambda w=worker, b=full: w.update_actor(b))
        results[share] = (full[schema.OLD_LOG_PROBS], metrics)
        rows[share] = sum(s[0] for s in shapes)
    mask = batch[schema.RESPONSE_MASK].bool()
    torch.testing.assert_close(results[True][0][mask], results[False][0][mask], atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert results[True][1][key] == pytest.approx(results[False][1][key], rel=1e-4, abs=1e-6), key
    assert rows[True] < rows[False] == 8


def test_eager_attention_gets_an_additive_mask_and_others_a_clear_error(policy):
    batch = _batch(seed=5)
    with torch.no_grad():
        sdpa, _ = response_log_probs(policy, batch, 1.0, share_prompts=True)
        policy.config._attn_implementation = "eager"
        try:
            eager, _ = response_log_probs(policy, batch, 1.0, share_prompts=True)
            policy.config._attn_implementation = "flash_attention_2"
            with pytest.raises(ValueError, match="trainer.prefix_grouper=false"):
                response_log_probs(policy, batch, 1.0, share_prompts=True)
        finally:
            policy.config._attn_implementation = "sdpa"
    inside = _within_extent()
    torch.testing.assert_close(eager[inside], sdpa[inside], atol=1e-5, rtol=0)  # eager's softmax is fp32
