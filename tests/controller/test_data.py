"""The dataset side of the prompt feeder: templating, max_prompt_length, epochs and step arithmetic."""

from __future__ import annotations

import logging

import pytest

from common import schema
from common.ground_truth import decode_ground_truth
from common.models import apply_chat_template, build_tiny_tokenizer
from controller.config import DataConfig
from controller.data import (
    PromptDataset,
    check_total_steps,
    num_available_steps,
    prompt_fields,
)
from controller.tasks import TaskRecord


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _records(num: int) -> list[TaskRecord]:
    return [TaskRecord(f"repeat the word {'abcdefgh'[i % 8]}", {"answer": "abcdefgh"[i % 8], "row": i})
            for i in range(num)]


def _dataset(tok, num: int, **cfg) -> PromptDataset:
    return PromptDataset.from_records(_records(num), DataConfig(task="tiny_repeat", **cfg), tok)


def test_total_steps_beyond_the_data_is_rejected_naming_all_four():
    with pytest.raises(ValueError) as info:
        check_total_steps(dataset_size=32, train_batch_size=8, epochs=1, total_steps=10)
    message = str(info.value)
    for needle in ("trainer.total_steps=10", "dataset size 32", "data.train_batch_size=8", "data.epochs=1"):
        assert needle in message
    assert check_total_steps(32, 8, 1, 4) == 4


def test_partial_final_batch_is_a_step_unless_drop_last(tok):
    dataset = _dataset(tok, 3, train_batch_size=4, epochs=1)
    batches = list(dataset.batches(total_steps=1))
    assert len(batches) == 1 and len(batches[0].prompts) == 3
    assert num_available_steps(3, 4, 1, drop_last=False) == 1
    assert num_available_steps(3, 4, 1, drop_last=True) == 0
    # Epochs form one stream: only the run's last step may be partial (30 prompts -> 7 full steps + 2).
    assert num_available_steps(10, 4, 3, drop_last=False) == 8
    assert num_available_steps(10, 4, 3, drop_last=True) == 7
    with pytest.raises(ValueError, match="data.drop_last=True"):
        _dataset(tok, 3, train_batch_size=4, drop_last=True).check_total_steps(1)


def test_batches_yield_exactly_total_steps_over_epochs(tok):
    dataset = _dataset(tok, 10, train_batch_size=4, epochs=3, seed=5)
    batches = list(dataset.batches(total_steps=7))
    assert [b.global_step for b in batches] == list(range(7))
    assert [b.epoch for b in batches] == [0, 0, 0, 1, 1, 2, 2]  # step 2 spans epochs 0 and 1
    assert [len(b.prompts) for b in batches] == [4] * 7
    stream = [p.index for b in batches for p in b.prompts]
    order0, order1 = stream[:10], stream[10:20]
    assert sorted(order0) == sorted(order1) == list(range(10))  # every prompt exactly once per epoch
    assert order0 != order1                                      # in a different order each epoch
    last = list(dataset.batches(total_steps=8))[-1]
    assert len(last.prompts) == 2 and last.epoch == 2             # only the run's last step is partial
    # Resuming at step 4 yields the same batches as the uninterrupted run.
    resumed = list(dataset.batches(total_steps=7, start_step=4))
    assert resumed == batches[4:]
    with pytest.raises(ValueError, match="trainer.total_steps=10"):
        next(dataset.batches(total_steps=10))


def test_no_shuffle_keeps_dataset_order(tok):
    dataset = _dataset(tok, 5, train_batch_size=2, shuffle=False)
    assert [p.index for b in dataset.batches(3) for p in b.prompts] == [0, 1, 2, 3, 4]


def test_chat_template_and_system_prompt(tok):
    plain = _dataset(tok, 1, train_batch_size=1)
    assert plain.prompts[0].input_ids == tuple(apply_chat_template(tok, "repeat the word a"))
    with_system = _dataset(tok, 1, train_batch_size=1, system_prompt="say the answer")
    ids = with_system.prompts[0].input_ids
    assert ids == tuple(apply_chat_template(tok, "repeat the word a", "say the answer"))
    assert tok.decode(ids).startswith("system : say the answer")


def test_max_prompt_length_error_names_row_and_length(tok):
    records = _records(3)
    records[1] = TaskRecord("repeat the word a " * 10, {"answer": "a"})
    long_len = len(apply_chat_template(tok, records[1].prompt))
    cfg = DataConfig(task="tiny_repeat", max_prompt_length=12, train_batch_size=1)
    with pytest.raises(ValueError, match=f"data row 2: prompt is {long_len} tokens.*max_prompt_length=12"):
        PromptDataset.from_records(records, cfg, tok)


def test_long_prompt_of_a_jsonl_file_is_named_by_its_line(tok, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "repeat the word a", "answer": "a"}\n\n'
                    + '{"prompt": "%s", "answer": "a"}\n' % ("repeat the word a " * 10))
    cfg = DataConfig(task=str(path), max_prompt_length=12, train_batch_size=1)
    with pytest.raises(ValueError, match="data.jsonl:3: prompt is .* tokens.*max_prompt_length=12"):
        PromptDataset.splits(cfg, tok)[0]


def test_skip_long_prompts_counts_and_logs(tok, caplog):
    records = _records(4)
    records[2] = TaskRecord("repeat the word a " * 10, {"answer": "a"})
    cfg = DataConfig(task="tiny_repeat", max_prompt_length=12, skip_long_prompts=True, train_batch_size=2)
    with caplog.at_level(logging.WARNING):
        dataset = PromptDataset.from_records(records, cfg, tok)
    assert len(dataset) == 3 and dataset.num_skipped == 1
    assert [p.index for p in dataset.prompts] == [0, 1, 3]
    assert "skipped 1 of 4 prompts" in caplog.text and "(rows [3], counting from 1)" in caplog.text
    everything_long = DataConfig(task="tiny_repeat", max_prompt_length=2, skip_long_prompts=True)
    with pytest.raises(ValueError, match="no prompts left after skipping 4"):
        PromptDataset.from_records(records, everything_long, tok)


def test_splits_tiny_repeat(tok):
    cfg = DataConfig(task="tiny_repeat", size=16, train_batch_size=8, max_prompt_length=32)
    dataset = PromptDataset.splits(cfg, tok)[0]
    assert len(dataset) == 16 and dataset.num_available_steps() == 2
    assert max(len(p.input_ids) for p in dataset.prompts) <= 12  # short: 4 words + chat template


def test_prompt_fields_store_each_prompt_once(tok):
    dataset = _dataset(tok, 2, train_batch_size=2, system_prompt="")
    prompts = list(dataset.prompts)
    prompts[1] = type(prompts[1])(1, prompts[1].input_ids[:-2], prompts[1].ground_truth)  # a shorter one
    fields, tags = prompt_fields(prompts, pad_token_id=tok.pad_token_id, uids=["u0", "u1"])
    ids, mask = fields["input_ids"], fields["attention_mask"]
    width = len(prompts[0].input_ids)
    assert ids.shape == (2, width) and mask.shape == (2, width)  # one row per group, whatever rollout.n
    assert tags == [{"uid": "u0"}, {"uid": "u1"}]
    assert tuple(ids[1, 2:].tolist()) == prompts[1].input_ids and ids[1, :2].tolist() == [tok.pad_token_id] * 2
    assert mask[1].tolist() == [0, 0] + [1] * (width - 2) and mask[0].sum() == width
    assert decode_ground_truth(fields["ground_truth"][1]) == prompts[1].ground_truth
    schema.check_batch(schema.FEEDER, fields, tags)  # exactly the contract's fields, dtypes and shapes
    with pytest.raises(ValueError, match="2 prompts but 1 uids"):
        prompt_fields(prompts, tok.pad_token_id, ["u0"])


def test_a_prompt_leaving_no_room_in_the_context_is_rejected_naming_its_row(tok):
    ds = _dataset(tok, 4)
    longest = max(len(p.input_ids) for p in ds.prompts)
    ds.check_context(longest + 1)  # one token of room is enough: the response is truncated, not refused
    with pytest.raises(ValueError, match=rf"data row 1: prompt is {longest} tokens .* context length of {longest}"):
        ds.check_context(longest)


def test_start_checks_reject_no_room_and_top_k_beyond_the_vocabulary():
    """``controller.job.check_config`` reads the model's config (no weights, no data) and returns its context
    length, against which the prompt feeder checks every prompt."""
    from controller.config import load_config
    from controller.feeder import PromptFeeder
    from controller.job import StartError, check_config

    base = ["data.size=32", "trainer.total_steps=1"]
    cfg = load_config(preset="tiny", overrides=[*base, "model.tiny.max_position_embeddings=8"])
    assert check_config(cfg) == 8
    with pytest.raises(ValueError, match="no room for a response within the model's context length of 8"):
        PromptFeeder(cfg, 1, check_config(cfg), "prompts")
    with pytest.raises(StartError, match=r"rollout.top_k=100000 exceeds the model's vocabulary"):
        check_config(load_config(preset="tiny", overrides=[*base, "rollout.top_k=100000"]))
