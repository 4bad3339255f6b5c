"""The trained policy exported as a Hugging Face model directory (``trainers/export.py``), from a live
trainer and from a DCP checkpoint, loaded back by transformers and by ``model.path``: same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from common import models
from common.models import ModelConfig
from tests.trainers._trainer_batches import make_batch, single_rank_group, with_training_fields
from trainers import export, fsdp
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.worker import TrainerWorker

TINY = ModelConfig(path="tiny")
PROMPTS = ("repeat the word c", "say the word q", "copy the word 7")
NEW_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from single_rank_group()


@pytest.fixture(scope="module")
def trained():
    """A tiny-model trainer after one actor update, so its weights differ from the initial ones."""
    cfg = TrainerConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=8, lr=1e-2, num_threads=1, total_steps=2)
    worker = TrainerWorker(cfg, AlgorithmConfig(), TINY, temperature=1.0, max_response_length=5)
    initial = worker.full_state_dict()
    worker.update_actor(with_training_fields(worker, make_batch(num_groups=2, n=4, seed=0)))
    assert any(not torch.equal(initial[k], t) for k, t in worker.full_state_dict().items())
    return worker


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt_ids: list[int], num_tokens: int = NEW_TOKENS) -> list[int]:
    """``num_tokens`` argmax tokens after ``prompt_ids`` (no stop), one full forward per token."""
    ids = torch.tensor([prompt_ids])
    for _ in range(num_tokens):
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def trainer_greedy(worker: TrainerWorker, prompt_ids: list[int]) -> list[int]:
    out = greedy(worker.policy, prompt_ids)
    fsdp.reshard(worker.policy)  # a no_grad forward leaves the FSDP2 root unsharded
    return out


def test_export_loads_back_with_the_trainers_greedy_outputs(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    trained.export_model(str(out))
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()            # plain transformers
    hf_tok = AutoTokenizer.from_pretrained(out)
    as_path = ModelConfig(path=str(out))                                    # model.path=<export>
    path_model, path_tok = models.load_model(as_path), models.load_tokenizer(as_path)
    tiny_tok = models.load_tokenizer(TINY)
    assert hf_tok.chat_template == tiny_tok.chat_template
    for prompt in PROMPTS:
        ids = models.apply_chat_template(tiny_tok, prompt)
        assert models.apply_chat_template(hf_tok, prompt) == ids == models.apply_chat_template(path_tok, prompt)
        expected = trainer_greedy(trained, ids)
        assert greedy(hf_model, ids) == expected == greedy(path_model, ids)
        generated = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert generated[0, len(ids):].tolist() == expected


def test_export_from_checkpoint_equals_export_from_trainer(trained, tmp_path):
    from safetensors.torch import load_file

    trained.save_checkpoint(str(tmp_path / "ckpt"))
    trained.export_model(str(tmp_path / "live"))
    export.export_checkpoint(tmp_path / "ckpt", TINY, tmp_path / "from_ckpt")
    live, from_ckpt = (load_file(tmp_path / d / "model.safetensors") for d in ("live", "from_ckpt"))
    assert live.keys() == from_ckpt.keys()
    for name, tensor in live.items():
        assert torch.equal(tensor, from_ckpt[name]), name
    model = models.load_model(ModelConfig(path=str(tmp_path / "from_ckpt")))
    ids = models.apply_chat_template(models.load_tokenizer(TINY), PROMPTS[0])
    assert greedy(model, ids) == trainer_greedy(trained, ids)


def test_export_refuses_an_existing_directory_and_a_missing_checkpoint(trained, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        export.export_state(trained.full_state_dict(), TINY, tmp_path / "taken")
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint"):
        export.export_checkpoint(tmp_path / "nothing", TINY, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mismatched_weights_are_named(trained):
    state = trained.full_state_dict()
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        export.load_full_state(export.policy_skeleton(TINY), {**state, "extra.weight": torch.zeros(1)})
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        export.load_full_state(export.policy_skeleton(TINY), state)
