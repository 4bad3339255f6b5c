"""trainers.batching.micro_batch_plan: micro-batches by sample count and, with a budget, by tokens."""

from __future__ import annotations

import pytest

from common import schema
from tests.trainers._trainer_batches import make_batch
from trainers.batching import length_order, micro_batch_plan


def _long_tail_batch() -> dict:
    """16 samples, prompts of 4-6 real tokens, responses of 1-40 valid tokens (a few long ones)."""
    batch = make_batch(num_groups=4, n=4, prompt_len=6, response_len=40, seed=11)
    lengths = [2, 3, 1, 40, 4, 2, 3, 5, 38, 2, 1, 3, 4, 2, 30, 6]
    mask = batch[schema.RESPONSE_MASK]
    for row, n in enumerate(lengths):
        mask[row] = 0
        mask[row, :n] = 1
    return batch


def _forward_tokens(batch: dict, rows: list[int]) -> int:
    """Tokens of one micro-batch's forward after trim_padding: rows × (longest prompt + longest response)."""
    prompt = batch[schema.ATTENTION_MASK].sum(1)
    extent = batch[schema.RESPONSE_MASK].sum(1)  # masks here are contiguous from column 0
    return len(rows) * (max(int(prompt[r]) for r in rows) + max(int(extent[r]) for r in rows))


@pytest.mark.parametrize("budget", [0, 60, 100, 400])
def test_every_sample_once_within_count_and_budget_and_greedy(budget):
    batch = _long_tail_batch()
    order, slices = micro_batch_plan(batch, 8, budget)
    assert order == length_order(batch)
    assert [i for s in slices for i in order[s]] == order  # each sample exactly once, in length order
    for k, s in enumerate(slices):
        rows = order[s]
        assert 1 <= len(rows) <= 8
        if budget and len(rows) > 1:
            assert _forward_tokens(batch, rows) <= budget
        if k + 1 < len(slices):  # the next sample did not fit: the cut is not smaller than it has to be
            grown = order[s.start : s.stop + 1]
            assert len(grown) > 8 or (budget and _forward_tokens(batch, grown) > budget)
    if budget == 0:
        assert [len(order[s]) for s in slices] == [8, 8]


def test_a_budget_puts_long_samples_few_to_a_pass_and_saves_padding():
    batch = _long_tail_batch()
    order, by_count = micro_batch_plan(batch, 8)
    _, by_tokens = micro_batch_plan(batch, 8, 100)
    assert len(by_tokens) > len(by_count)
    assert [len(order[s]) for s in by_tokens][-1] < 8  # the longest samples share a pass with few others
    cost = lambda slices: sum(_forward_tokens(batch, order[s]) for s in slices)  # noqa: E731
    assert cost(by_tokens) < cost(by_count)
    _, tiny = micro_batch_plan(batch, 8, 1)  # every sample over the budget: one per pass, none dropped
    assert [s.stop - s.start for s in tiny] == [1] * 16


@pytest.mark.parametrize("share_prompts", [False, True])
def test_a_rank_without_samples_gets_an_empty_plan(share_prompts):
    assert micro_batch_plan(None, 8, 100, share_prompts) == ([], [])
