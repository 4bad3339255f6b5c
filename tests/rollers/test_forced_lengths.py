"""``rollout.forced_response_lengths`` (the long-tail workload of ``bench/modes_bench.py``) and the roller's
busy intervals (``timeline.json``)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from common import schema
from common.models import ModelConfig, load_tokenizer
from rollers.config import RolloutConfig
from rollers.roller import forced_response_length
from tests.rollers.engine_helpers import run, spiced_tiny
from tests.rollers.test_roller import N, _roll, make_group

BUCKETS = [[3, 1, 2], [1, 7, 8]]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="module")
def model():
    return spiced_tiny()


def test_forced_length_is_a_pure_function_of_seed_uid_and_index():
    rollout = RolloutConfig(n=N, max_response_length=8, seed=3, forced_response_lengths=BUCKETS)
    draws = [forced_response_length(rollout, f"s{i}.p0", j) for i in range(200) for j in range(N)]
    again = [forced_response_length(rollout, f"s{i}.p0", j) for i in range(200) for j in range(N)]
    assert draws == again
    assert set(draws) <= {1, 2, 7, 8}
    short = sum(d <= 2 for d in draws) / len(draws)
    assert 0.65 < short < 0.85  # weights 3:1 -> 75% short
    other_seed = RolloutConfig(n=N, max_response_length=8, seed=4, forced_response_lengths=BUCKETS)
    assert draws != [forced_response_length(other_seed, f"s{i}.p0", j) for i in range(200) for j in range(N)]
    assert forced_response_length(RolloutConfig(n=N), "u", 0) is None


def test_roller_decodes_exactly_the_forced_lengths(model, tok):
    rollout = RolloutConfig(n=N, max_response_length=8, seed=3, forced_response_lengths=BUCKETS)
    groups = [make_group(tok, i) for i in range(6)]
    results, roller = run(_roll(model, tok, groups, rollout=rollout))
    lengths = Counter()
    for group in groups:
        fields = results[group.uid].fields
        for row in range(N):
            want = forced_response_length(rollout, group.uid, row)
            assert int(fields[schema.RESPONSE_LENGTH][row]) == want
            assert int(fields[schema.RESPONSE_MASK][row].sum()) == want
            assert fields[schema.FINISH_REASON][row] == "length"  # EOS ignored
            lengths[want] += 1
    assert any(k <= 2 for k in lengths) and any(k >= 7 for k in lengths)
    assert roller.stats()["truncation_ratio"] == 1.0


@pytest.mark.parametrize("buckets", [[[1, 0, 2]], [[0, 1, 2]], [[1, 3, 2]], [[1, 1, 9]], [[1, 2]]])
def test_bad_forced_lengths_are_rejected(buckets):
    with pytest.raises(ValueError, match="rollout.forced_response_lengths"):
        RolloutConfig(max_response_length=8, forced_response_lengths=buckets)


def test_busy_intervals_cover_the_generation(model, tok):
    before = time.time()
    results, roller = run(_roll(model, tok, [make_group(tok, i) for i in range(3)]))
    after = time.time()
    intervals = roller.busy_intervals()
    assert intervals and len(results) == 3
    for (_, e0), (s1, _) in zip(intervals, intervals[1:], strict=False):
        assert e0 <= s1
    assert all(before <= s <= e <= after for s, e in intervals)
    busy = sum(e - s for s, e in intervals)
    assert busy == pytest.approx(roller._counters.busy_s, rel=0.05, abs=0.02)
