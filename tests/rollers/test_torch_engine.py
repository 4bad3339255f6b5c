"""TorchEngine generation correctness: greedy parity with HF ``generate``, log-probs, stops, seeds, streams.

The ``tiny`` model's stock init (std 0.02) is nearly uniform and repeats one token; the tests re-draw its
matrices with std 0.2 (seeded) so greedy outputs vary and sampling has entropy (~3 nats over 52 tokens).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.models import ModelConfig, apply_chat_template, load_model, load_tokenizer
from rollers.engine import GenerationRequest, SamplingParams
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import run, spiced_tiny

TINY_PROMPTS = ("repeat the word a b c", "say 1 2 3", "copy the word z", "answer is 7 .", "say a")




def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Reference: HF ``generate`` greedy on one unpadded prompt (stops at the model's EOS ids)."""
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([list(prompt_ids)], device=device), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def teacher_forced_log_probs(model, prompt_ids, output_ids, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``output_ids`` from one full forward over prompt + output."""
    ids = torch.tensor([[*prompt_ids, *output_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, dim=-1).gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def request(rid: str, prompt_ids, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt_ids), SamplingParams(**sampling))


@pytest.fixture(scope="module")
def tiny():
    tok = load_tokenizer(ModelConfig(path="tiny"))
    return spiced_tiny(), tok, [apply_chat_template(tok, p) for p in TINY_PROMPTS]


@pytest.fixture(scope="module")
def smollm2():
    cfg = ModelConfig(path="smollm2-135m-instruct")
    tok = load_tokenizer(cfg)
    prompts = ("What is 2+3?", "Name a color.", "Write one word about the sea.")
    return load_model(cfg), tok, [apply_chat_template(tok, p) for p in prompts]


async def _generate_with_joins(engine: TorchEngine, prompts, max_new_tokens: int, join_after: int):
    """Start prompt 0, then submit each next prompt once the previous one has ``join_after`` tokens."""
    results: dict[int, object] = {}
    joined = [asyncio.Event() for _ in prompts]
    peak_running = 0

    async def consume(i):
        nonlocal peak_running
        async for out in engine.stream(request(f"r{i}", prompts[i], max_new_tokens=max_new_tokens, temperature=0)):
            peak_running = max(peak_running, engine.stats()["num_running"])
            if len(out.output_ids) >= join_after or out.finish_reason:
                joined[i].set()
            results[i] = out

    tasks = []
    for i in range(len(prompts)):
        tasks.append(asyncio.create_task(consume(i)))
        await joined[i].wait()
    await asyncio.gather(*tasks)
    assert peak_running >= 2  # the later prompts really joined while earlier ones were decoding
    return [results[i] for i in range(len(prompts))]


def _check_greedy(model, tok, prompts, max_new_tokens, slots, modes):
    """Engine greedy == HF greedy for every prompt, in each of ``modes``: ``alone`` (one at a time),
    ``together`` (submitted at once), ``joining`` (each joins while the previous ones decode)."""
    refs = [hf_greedy(model, p, max_new_tokens) for p in prompts]

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=slots)
        results = {}
        try:
            if "alone" in modes:
                results["alone"] = [
                    await engine.generate(request(f"a{i}", p, max_new_tokens=max_new_tokens, temperature=0))
                    for i, p in enumerate(prompts)
                ]
            if "together" in modes:
                results["together"] = await asyncio.gather(*[
                    engine.generate(request(f"b{i}", p, max_new_tokens=max_new_tokens, temperature=0))
                    for i, p in enumerate(prompts)
                ])
            if "joining" in modes:
                results["joining"] = await _generate_with_joins(engine, prompts, max_new_tokens, join_after=3)
            return results, engine.stats()
        finally:
            await engine.shutdown()

    results, stats = run(body())
    assert sorted(results) == sorted(modes)
    for outs in results.values():
        assert [o.output_ids for o in outs] == refs
    assert stats["num_tokens_generated"] == len(modes) * sum(len(r) for r in refs)
    return refs, results


def test_greedy_equals_hf_generate_tiny(tiny):
    model, tok, prompts = tiny
    refs, _ = _check_greedy(model, tok, prompts, max_new_tokens=24, slots=3, modes=("alone", "together", "joining"))
    assert len({tuple(r) for r in refs}) == len(refs)  # the prompts really give different outputs


def test_greedy_equals_hf_generate_smollm2(smollm2):
    model, tok, prompts = smollm2
    refs, results = _check_greedy(model, tok, prompts, max_new_tokens=8, slots=4, modes=("joining",))
    assert all(o.finish_reason in ("stop", "length") for o in results["joining"])


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.0, 1.0, -1), (1.0, 1.0, -1), (0.7, 0.9, 10)])
def test_log_probs_equal_teacher_forced_forward(tiny, temperature, top_p, top_k):
    model, tok, prompts = tiny

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4)
        try:
            return await asyncio.gather(*[
                engine.generate(request(f"r{i}", p, max_new_tokens=16, temperature=temperature, top_p=top_p,
                                        top_k=top_k, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)
            ])
        finally:
            await engine.shutdown()

    for prompt, out in zip(prompts, run(body()), strict=True):
        expected = teacher_forced_log_probs(model, prompt, out.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.output_log_probs), expected, atol=1e-4, rtol=0)
        assert out.weight_versions == [0] * len(out.output_ids)


def test_log_probs_smollm2(smollm2):
    model, tok, prompts = smollm2

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2)
        try:
            return await engine.generate(request("r", prompts[0], max_new_tokens=8, temperature=1.0, seed=3))
        finally:
            await engine.shutdown()

    out = run(body())
    expected = teacher_forced_log_probs(model, prompts[0], out.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(out.output_log_probs), expected, atol=1e-4, rtol=0)


def test_length_and_stop_on_any_eos(tiny):
    model, tok, prompts = tiny
    greedy = hf_greedy(model, prompts[0], 12)
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])  # first fresh token, index >= 2
    extra_eos = greedy[k]

    async def body():
        # The model's generation_config lists several EOS ids; hitting any of them stops the request.
        engine = TorchEngine(model, [tok.eos_token_id, extra_eos], max_batch_slots=2)
        try:
            stop = await engine.generate(request("s", prompts[0], max_new_tokens=12, temperature=0))
            ignored = await engine.generate(request("i", prompts[0], max_new_tokens=12, temperature=0, ignore_eos=True))
            stop_id = await engine.generate(request("t", prompts[0], max_new_tokens=12, temperature=0,
                                                    ignore_eos=True, stop_token_ids=(greedy[1],)))
            return stop, ignored, stop_id
        finally:
            await engine.shutdown()

    stop, ignored, stop_id = run(body())
    assert stop.finish_reason == "stop" and stop.output_ids == greedy[: k + 1]
    assert stop.output_ids[-1] == extra_eos
    assert ignored.finish_reason == "length" and len(ignored.output_ids) == 12
    assert stop_id.finish_reason == "stop" and stop_id.output_ids == greedy[:2]


def test_eos_from_generation_config(tiny):
    model, tok, prompts = tiny
    greedy = hf_greedy(model, prompts[1], 8)
    model.generation_config.eos_token_id = [tok.eos_token_id, greedy[0]]
    async def body():
        engine = TorchEngine(model, [], max_batch_slots=1)
        assert {tok.eos_token_id, greedy[0]} <= engine.eos_ids
        try:
            return await engine.generate(request("r", prompts[1], max_new_tokens=8, temperature=0))
        finally:
            await engine.shutdown()

    try:
        out = run(body())
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    assert out.finish_reason == "stop" and out.output_ids == greedy[:1]


def test_seeds_make_groups_differ_and_ignore_batch_composition(tiny):
    model, tok, _ = tiny
    prompts = [apply_chat_template(tok, f"say {w} {d}") for w, d in zip("abcdefghij", "0123456789", strict=True)]
    n = 4

    def group_requests(prompt_index, tag):
        return [request(f"{tag}{prompt_index}-{s}", prompts[prompt_index], max_new_tokens=10, temperature=1.0,
                        seed=1000 * prompt_index + s) for s in range(n)]

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=8)
        try:
            full = await asyncio.gather(*[engine.generate(r) for i in range(10) for r in group_requests(i, "a")])
            # Same seeds, different neighbours: groups alone, in reverse order, mixed with unseeded noise.
            alone = [await engine.generate(r) for r in group_requests(3, "b")]
            noise = [request(f"n{j}", prompts[j], max_new_tokens=10, temperature=1.0) for j in range(5)]
            mixed = await asyncio.gather(*[engine.generate(r) for r in [*noise, *group_requests(7, "c")][::-1]])
            return full, alone, mixed[:n][::-1]
        finally:
            await engine.shutdown()

    full, alone, mixed = run(body())
    groups = [full[i * n : (i + 1) * n] for i in range(10)]
    identical = sum(len({tuple(o.output_ids) for o in g}) == 1 for g in groups)
    assert identical / len(groups) < 0.1
    assert [o.output_ids for o in alone] == [o.output_ids for o in groups[3]]
    assert [o.output_ids for o in mixed] == [o.output_ids for o in groups[7]]
    for a, b in zip(alone, groups[3], strict=True):
        torch.testing.assert_close(torch.tensor(a.output_log_probs), torch.tensor(b.output_log_probs), atol=1e-5, rtol=0)


def test_identical_prompts_are_prefilled_once(tiny):
    """A group's identical prompts share one prefill row (KV copied to the others' slots); every sample
    still draws from its own seed exactly as when prefilled alone."""
    model, tok, prompts = tiny
    reqs = [request(f"g{s}", prompts[0], max_new_tokens=8, temperature=1.0, seed=s, ignore_eos=True)
            for s in range(3)]
    reqs.append(request("o", prompts[1], max_new_tokens=8, temperature=1.0, seed=9, ignore_eos=True))

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4)
        try:
            together = await asyncio.gather(*[engine.generate(r) for r in reqs])
            prefill_tokens = engine.stats()["num_prefill_tokens"]
            alone = [await engine.generate(r) for r in reqs]
            return together, alone, prefill_tokens
        finally:
            await engine.shutdown()

    together, alone, prefill_tokens = run(body())
    assert prefill_tokens == 2 * max(len(prompts[0]), len(prompts[1]))  # two distinct prompts, one forward
    assert [o.output_ids for o in together] == [o.output_ids for o in alone]
    assert len({tuple(o.output_ids) for o in together[:3]}) > 1  # the seeds, not the shared prefill, decide
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(torch.tensor(a.output_log_probs), torch.tensor(b.output_log_probs), atol=1e-5, rtol=0)


def test_stream_yields_growing_outputs(tiny):
    model, tok, prompts = tiny

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2)
        try:
            snaps = [snap async for snap in engine.stream(request("r", prompts[0], max_new_tokens=6,
                                                                    temperature=0, ignore_eos=True))]
            return snaps, engine.stats()
        finally:
            await engine.shutdown()

    snaps, stats = run(body())
    assert len(snaps) >= 2 and snaps[-1].prompt_tokens == len(prompts[0])
    assert stats["num_tokens_generated"] == 6 and stats["num_requests_in_flight"] == 0
    assert stats["tokens_per_s"] > 0 and 0 < stats["busy_ratio"] <= 1 and stats["busy_s"] <= stats["uptime_s"]
    assert [s.finish_reason for s in snaps[:-1]] == [None] * (len(snaps) - 1)
    assert snaps[-1].finish_reason == "length" and len(snaps[-1].output_ids) == 6
    for early, late in zip(snaps, snaps[1:], strict=False):
        assert late.output_ids[: len(early.output_ids)] == early.output_ids
        assert len(late.output_ids) > len(early.output_ids)


def tiny_qwen2(**overrides) -> torch.nn.Module:
    """A small Qwen2 (q/k/v biases, another attention implementation than Llama), matrices ~ N(0, 0.2²)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=52, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=2, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.2 if param.dim() > 1 else 0.05) + (param.dim() == 1))
    return model


def test_other_architecture_qwen2(tiny):
    _, tok, prompts = tiny
    model = tiny_qwen2()
    refs, _ = _check_greedy(model, tok, prompts[:3], max_new_tokens=16, slots=2, modes=("together", "joining"))
    assert len({tuple(r) for r in refs}) == 3


def test_sliding_window_caps_max_seq_len_and_other_layers_are_refused(tiny):
    _, tok, prompts = tiny
    engine = TorchEngine(tiny_qwen2(use_sliding_window=True, sliding_window=24, max_window_layers=0), tok)
    assert engine.max_seq_len == 24
    out = run(engine.generate(request("r", prompts[0], max_new_tokens=24, ignore_eos=True)))
    assert out.finish_reason == "length" and len(prompts[0]) + len(out.output_ids) == 24  # cut at the window
    with pytest.raises(ValueError, match="max_seq_len=24"):
        run(engine.generate(request("r", [1] * 24, max_new_tokens=1)))
    with pytest.raises(ValueError, match="chunked_attention"):
        TorchEngine(tiny_qwen2(layer_types=["full_attention", "chunked_attention"]), tok)


@pytest.mark.gpu
def test_greedy_and_log_probs_on_gpu():
    cfg = ModelConfig(path="smollm2-135m-instruct")
    tok = load_tokenizer(cfg)
    model = load_model(cfg, device="cuda")
    prompts = [apply_chat_template(tok, p) for p in ("What is 2+3?", "Name a color.")]
    refs = [hf_greedy(model, p, 12) for p in prompts]

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4)
        try:
            greedy = await asyncio.gather(*[
                engine.generate(request(f"g{i}", p, max_new_tokens=12, temperature=0)) for i, p in enumerate(prompts)
            ])
            sampled = await engine.generate(request("s", prompts[0], max_new_tokens=12, temperature=1.0, seed=1))
            return greedy, sampled
        finally:
            await engine.shutdown()

    greedy, sampled = run(body())
    assert [o.output_ids for o in greedy] == refs
    ids = torch.tensor([[*prompts[0], *sampled.output_ids]], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompts[0]) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled.output_ids, device="cuda")[:, None])
    torch.testing.assert_close(torch.tensor(sampled.output_log_probs), expected[:, 0].cpu(), atol=1e-4, rtol=0)



def test_the_busy_flag_is_set_while_requests_are_in_flight_and_closed_at_shutdown(tiny):
    """``busy_flag`` (``common.core_lending``): busy while the engine decodes, idle once nothing is in flight."""
    model, tok, prompts = tiny

    class Flag:
        def __init__(self):
            self.calls, self.closed = [], False

        def set(self, busy):
            self.calls.append(busy)

        def close(self):
            self.closed = True

    flag = Flag()

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2, busy_flag=flag)
        try:
            await engine.generate(request("a", prompts[0], max_new_tokens=4, temperature=0))
            for _ in range(5):
                await asyncio.sleep(0)  # the loop finds nothing in flight and waits
            return list(flag.calls)
        finally:
            await engine.shutdown()

    calls = run(body())
    assert True in calls and calls[-1] is False and flag.closed
