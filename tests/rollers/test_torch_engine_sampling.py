"""The torch engine's sampler (``rollers.sampling``): filtering, frequencies, per-row generators, log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from rollers.sampling import RowSampling, SamplingError, sample_tokens

# Deliberately not sorted: the unfiltered path walks token ids, the filtered one walks sorted probabilities.
PROBS = torch.tensor([0.07, 0.5, 0.03, 0.25, 0.15])
LOGITS = torch.log(PROBS)


def row(seed: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> RowSampling:
    return RowSampling(temperature, top_p, top_k, torch.Generator().manual_seed(seed))


def frequencies(num_draws: int, **settings) -> torch.Tensor:
    rows = [row(seed, **settings) for seed in range(num_draws)]
    tokens, _ = sample_tokens(LOGITS.expand(num_draws, -1), rows)
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).float() / num_draws


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, PROBS.tolist()),
        ({"top_k": 2}, [0, 2 / 3, 0, 1 / 3, 0]),
        ({"top_p": 0.8}, [0, 0.5 / 0.9, 0, 0.25 / 0.9, 0.15 / 0.9]),  # nucleus: 0.5+0.25 < 0.8, add 0.15
        ({"top_p": 0.8, "top_k": 2}, [0, 2 / 3, 0, 1 / 3, 0]),
        ({"temperature": 0.5}, torch.softmax(LOGITS / 0.5, -1).tolist()),
    ],
)
def test_sampled_frequencies_follow_the_filtered_distribution(settings, expected):
    freq = frequencies(4000, **settings)
    expected = torch.tensor(expected)
    assert torch.all(freq[expected == 0] == 0)  # filtered tokens are never drawn
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_log_probs_are_of_the_unfiltered_tempered_distribution():
    tokens, log_probs = sample_tokens(LOGITS.expand(3, -1), [row(0, 0.0), row(1, 0.5, top_k=1), row(2, 2.0)])
    assert tokens[0] == 1 and tokens[1] == 1  # greedy, and top-k 1
    for token, log_prob, temp in zip(tokens, log_probs, (1.0, 0.5, 2.0), strict=True):
        assert log_prob == pytest.approx(torch.log_softmax(LOGITS / temp, -1)[token].item(), abs=1e-6)


def test_each_row_depends_only_on_its_own_generator():
    """Same seed, same logits → same token, whatever the neighbours' logits and settings."""
    noisy = torch.randn(5, LOGITS.numel())
    neighbours = [row(1), row(2, top_p=0.5), row(3, top_k=2), row(4, 0.0), row(5)]
    for settings in ({}, {"top_p": 0.9}, {"top_k": 3}):
        for seed in range(20):
            alone, _ = sample_tokens(LOGITS[None], [row(seed, **settings)])
            mixed, _ = sample_tokens(torch.cat([noisy[:2], LOGITS[None], noisy[2:]]),
                                     [*neighbours[:2], row(seed, **settings), *neighbours[2:]])
            assert mixed[2] == alone[0], (settings, seed)
    with pytest.raises(ValueError, match="sampling rows"):
        sample_tokens(LOGITS.expand(2, -1), [row(0)])


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    """A top_k larger than the vocabulary used to make ``torch.topk`` raise inside the decode step."""
    freq = frequencies(4000, top_k=LOGITS.numel() + 10)
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_refused_rows_are_named_before_any_generator_is_drawn():
    rows = [row(0), RowSampling(math.nan, 1.0, -1, torch.Generator().manual_seed(1)), row(2, top_p=math.nan)]
    states = [r.generator.get_state() for r in rows]
    with pytest.raises(SamplingError) as info:
        sample_tokens(LOGITS.expand(3, -1), rows)
    assert sorted(info.value.errors) == [1, 2] and "temperature" in info.value.errors[1]
    assert all(torch.equal(r.generator.get_state(), s) for r, s in zip(rows, states, strict=True))


def test_a_tiny_temperature_is_greedy_never_nan():
    """logits / 1e-300 overflows fp32 (NaN log-probs): below GREEDY_BELOW a row is sampled greedily."""
    tokens, log_probs = sample_tokens(LOGITS.expand(2, -1), [row(0, 1e-300), row(1, 1e-45)])
    assert tokens == [1, 1]
    assert log_probs == pytest.approx([math.log(0.5)] * 2, abs=1e-6)
