"""The prompt feeder holds the run's only load of the data: one load of ``data.task`` (training and held-out
rows together), one chat template per row, whatever the feeder is asked afterwards; the controller's own
start checks load no data. (A job whose data is bad is refused by the feeder: ``test_job.py``.)"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

import controller.data
from controller.config import load_config
from controller.feeder import DataFacts, FeederActor, PromptFeeder
from controller.job import check_config

OVERRIDES = ["data.size=12", "data.val_size=4", "data.val_disjoint=false", "data.train_batch_size=4", "trainer.ppo_mini_batch_size=4",
             "trainer.total_steps=3", "rollout.n=2"]


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts ``load_task_records`` calls and chat templates applied, wherever the data module makes them."""
    seen: Counter = Counter()
    load, template = controller.data.load_task_records, controller.data.apply_chat_template

    def counted_load(*args, **kwargs):
        seen["load"] += 1
        return load(*args, **kwargs)

    def counted_template(*args, **kwargs):
        seen["template"] += 1
        return template(*args, **kwargs)

    monkeypatch.setattr(controller.data, "load_task_records", counted_load)
    monkeypatch.setattr(controller.data, "apply_chat_template", counted_template)
    return seen


def test_one_load_and_one_template_per_row_whatever_the_feeder_is_asked(calls):
    cfg = load_config(preset="tiny", overrides=OVERRIDES)
    context_length = check_config(cfg)
    assert calls == {}  # the controller's start checks touch no data
    feeder = PromptFeeder(cfg, 3, context_length, "prompts", "validation_prompts")
    assert calls == {"load": 1, "template": 12 + 4}
    feeder.client = SimpleNamespace(put=lambda data, partition, tags: None, close=lambda: None)
    facts = feeder.facts()
    assert facts == DataFacts(num_prompts=12, num_skipped=0, num_val_prompts=4, num_val_skipped=0,
                              num_val_seen=facts.num_val_seen, max_prompt_tokens=facts.max_prompt_tokens,
                              num_available_steps=3)
    train_texts = {p.text for p in feeder.dataset.prompts}  # tiny_repeat's 8 prompts: its validation repeats them
    assert facts.num_val_seen == sum(p.text in train_texts for p in feeder.val_dataset.prompts) > 0
    assert 0 < facts.max_prompt_tokens < context_length
    assert [g["uid"] for g in feeder.feed(5)] == ["s0.p0", "s0.p1", "s0.p2", "s0.p3", "s1.p0"]
    assert feeder.feed_validation(0) == ["v0.p0", "v0.p1", "v0.p2", "v0.p3"]
    state = feeder.state()
    feeder.restore(state)  # what a resume does, and a re-issue of a prompt fed before it
    assert feeder.reissue(["s1.p0", "s0.p2"]) == [{"uid": "s1.p0.r1", "global_step": 1},
                                                   {"uid": "s0.p2.r1", "global_step": 0}]
    assert calls == {"load": 1, "template": 12 + 4}  # nothing loaded or tokenized again
    feeder.close()


def test_a_data_error_reaches_the_controller_as_the_feeders_valueerror(calls):
    """Too many steps for the data: the feeder's message names the dataset size and the keys, raised by
    ``facts()`` in the Ray actor's class (Ray would report a constructor's error only as the actor's death)."""
    cfg = load_config(preset="tiny", overrides=[*OVERRIDES, "trainer.total_steps=4"])
    with pytest.raises(ValueError, match="trainer.total_steps=4 exceeds the 3 steps the data provides: dataset "
                                         "size 12 prompts, data.train_batch_size=4, data.epochs=1"):
        PromptFeeder(cfg, 4, None, "prompts")
    actor = FeederActor(cfg, 4, None, "prompts")
    with pytest.raises(ValueError, match="dataset size 12 prompts"):
        actor.facts()
