"""The task registry: reasoning-gym, tiny-repeat and file datasets."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from common.models import build_tiny_tokenizer
from rollers.rewards import tiny_repeat_reward
from rollers.tasks import (
    decode_ground_truth,
    encode_ground_truth,
    load_task_records,
    task_kind,
)


def test_reasoning_gym_records_are_json_and_scorable_after_a_round_trip():
    kwargs = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    records = load_task_records("chain_sum", size=5, seed=1, task_kwargs=kwargs)
    assert len(records) == 5
    again = load_task_records("chain_sum", size=5, seed=1, task_kwargs=kwargs)
    assert records == again  # seeded
    gt = decode_ground_truth(encode_ground_truth(records[0].ground_truth))
    assert gt["task"] == "chain_sum" and gt["answer"] == records[0].ground_truth["answer"]
    assert "=" in records[0].prompt
    import reasoning_gym

    scorer = reasoning_gym.get_score_answer_fn("chain_sum")
    assert scorer(gt["answer"], {"answer": gt["answer"], "metadata": gt["metadata"]}) == 1.0


def test_reasoning_gym_bad_kwargs_and_names():
    with pytest.raises(ValueError, match="data.task_kwargs"):
        load_task_records("chain_sum", size=2, task_kwargs={"no_such_option": 1})
    with pytest.raises(ValueError, match="data.task='chain_summ'"):
        task_kind("chain_summ")
    with pytest.raises(ValueError, match=".jsonl"):
        task_kind("data/prompts.csv")


def test_tiny_repeat_prompts_fit_the_tiny_vocabulary():
    records = load_task_records("tiny-repeat", size=400, seed=0)
    tok = build_tiny_tokenizer()
    for record in records[:20]:
        ids = tok(record.prompt, add_special_tokens=False)["input_ids"]
        assert len(ids) == 4 and tok.unk_token_id not in ids
        assert record.prompt.split()[-1] == record.ground_truth["answer"]
    counts = Counter(r.ground_truth["answer"] for r in records)
    assert set(counts) == set("abcdefgh")
    # A constant answer cannot beat chance: the most frequent symbol is near 1/8.
    best_constant = max(counts.values()) / len(records)
    assert best_constant < 0.2
    assert sum(tiny_repeat_reward(r.ground_truth["answer"], r.ground_truth) for r in records) == len(records)


def test_tiny_repeat_kwargs():
    records = load_task_records("tiny-repeat", size=50, seed=0, task_kwargs={"num_symbols": 2})
    assert {r.ground_truth["answer"] for r in records} == {"a", "b"}
    with pytest.raises(ValueError, match="num_symbols"):
        load_task_records("tiny-repeat", size=5, task_kwargs={"num_symbols": 40})
    with pytest.raises(ValueError, match="accepts only"):
        load_task_records("tiny-repeat", size=5, task_kwargs={"bogus": 1})


def test_jsonl_file(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"question": "1+1?", "solution": "2"}, {"question": "2+2?", "solution": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = load_task_records(str(path), size=1, prompt_key="question", answer_key="solution")
    assert [r.prompt for r in records] == ["1+1?", "2+2?"]  # a file yields all rows whatever data.size
    assert [r.ground_truth for r in records] == [{"answer": "2"}, {"answer": 4}]
    with pytest.raises(ValueError, match="data.jsonl:1: no column data.prompt_key='prompt'"):
        load_task_records(str(path), size=1)


def test_file_rows_are_named_counting_from_one(tmp_path):
    """A .jsonl row is named FILE:LINE, as a JSON error names it (lines from 1, blank ones counted); a
    .parquet row FILE row N, from 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"question": "b", "answer": 2}\n')
    with pytest.raises(ValueError, match="data.jsonl:3: no column data.prompt_key='prompt'"):
        load_task_records(str(path), size=1)
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2}\n')
    assert [r.source for r in load_task_records(str(path), size=1)] == [f"{path}:1", f"{path}:3"]
    table = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "solution": ["1", "2"]}), table)
    with pytest.raises(ValueError, match="data.parquet row 1: no column data.answer_key='answer'"):
        load_task_records(str(table), size=1)


def test_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?", "c?"], "answer": ["1", "2", "3"]}), path)
    records = load_task_records(str(path), size=10)
    assert [(r.prompt, r.ground_truth["answer"]) for r in records] == [("a?", "1"), ("b?", "2"), ("c?", "3")]


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_task_records(str(tmp_path / "missing.jsonl"), size=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_task_records(str(bad), size=1)
    with pytest.raises(ValueError, match="takes none"):
        load_task_records(str(bad), size=1, task_kwargs={"x": 1})


def test_decode_ground_truth_rejects_non_dicts():
    with pytest.raises(ValueError, match="dict"):
        decode_ground_truth("[1, 2]")
