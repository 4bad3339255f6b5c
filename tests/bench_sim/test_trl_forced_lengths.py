"""The TRL peer's long-tail lengths (``bench/trl_peer.py``): HF ``generate`` ends each row after exactly the
length our rollers force on the same (step, group, sample), so both sides of the benchmark decode and train
the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import trl_peer
from controller.config import load_config
from rollers.response_fields import forced_response_length

EOS = 2
SPEC = {"n": 3, "seed": 11, "max_response_length": 12, "forced_response_lengths": [[3, 1, 4], [1, 9, 12]]}


def test_rows_get_the_lengths_our_rollers_force_on_the_same_group_and_sample():
    cfg = load_config(preset="tiny", overrides=["rollout.n=3", "rollout.seed=11", "rollout.max_response_length=12",
                                                "rollout.forced_response_lengths=[[3,1,4],[1,9,12]]"])
    lengths = trl_peer.forced_lengths(SPEC, 2, 6)  # step 2's call: groups s2.p0 and s2.p1, 3 samples each
    assert lengths == [forced_response_length(cfg.rollout, f"s2.p{row // 3}", row % 3) for row in range(6)]
    assert len(set(trl_peer.forced_lengths(SPEC, 0, 60) + trl_peer.forced_lengths(SPEC, 1, 60))) > 3
    with pytest.raises(ValueError, match="forced_response_lengths"):
        trl_peer.forced_lengths(dict(SPEC, forced_response_lengths=[]), 0, 6)


def test_generate_ends_each_row_at_its_length_with_its_eos_the_last_token():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS,
                                         bos_token_id=1, pad_token_id=0)).eval()
    boost = torch.zeros(16)
    boost[EOS] = 20.0  # EOS the likeliest token everywhere: without the processor every row ends at once
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + boost)
    calls = trl_peer.force_lengths(model, SPEC, [EOS, 5])
    prompt = torch.tensor([[1, 7, 8]] * 6)
    for call in range(2):
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             temperature=1.0, max_new_tokens=12, eos_token_id=[EOS, 5], pad_token_id=0)
        completions = out[:, prompt.shape[1]:]
        want = trl_peer.forced_lengths(SPEC, call, 6)
        for row, length in enumerate(want):
            tokens = completions[row].tolist()
            assert tokens[length - 1] == EOS, (row, length, tokens)
            assert not {EOS, 5} & set(tokens[:length - 1]), (row, length, tokens)
        assert calls[call] == sum(want)
    assert len(calls) == 2
