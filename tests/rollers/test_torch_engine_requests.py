"""Hostile requests to the torch engine: a bad request fails alone, before or while decoding, and the
engine keeps serving the good ones (issue #12); a response cut by the context length ends with
``finish_reason=length``."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from common.models import ModelConfig, apply_chat_template, load_tokenizer
from rollers.engine import GenerationRequest, SamplingParams
from rollers.sampling import RowSampling
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import run, spiced_tiny


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="module")
def prompt(tok):
    return tuple(apply_chat_template(tok, "repeat the word a b c"))


def sampled(rid: str, prompt, n: int = 24, **kw) -> GenerationRequest:
    kw.setdefault("seed", 7)
    return GenerationRequest(rid, tuple(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))


async def _good_outputs(model, tok, prompt):
    """The reference: two seeded requests served alone on a fresh engine."""
    engine = TorchEngine(model, tok, max_batch_slots=4)
    try:
        return await asyncio.gather(engine.generate(sampled("a", prompt, top_k=5)),
                                    engine.generate(sampled("b", prompt, seed=8)))
    finally:
        await engine.shutdown()


def test_bad_requests_between_good_ones_fail_alone(tok, prompt):
    model = spiced_tiny()
    vocab = model.get_output_embeddings().weight.shape[0]
    want = run(_good_outputs(model, tok, prompt))

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4, max_seq_len=128)
        try:
            good = [asyncio.create_task(engine.generate(sampled("a", prompt, top_k=5))),
                    asyncio.create_task(engine.generate(sampled("b", prompt, seed=8)))]
            await asyncio.sleep(0)  # the good ones are in the engine before the bad ones arrive
            bad = {
                "top_k beyond the vocabulary": sampled("k", prompt, top_k=vocab + 1),
                "stop id beyond the vocabulary": sampled("s", prompt, stop_token_ids=(vocab,)),
                "no room": GenerationRequest("p", (1,) * 128, SamplingParams(max_new_tokens=1)),
                "token id": GenerationRequest("t", (1, vocab), SamplingParams(max_new_tokens=1)),
            }
            for what, request in bad.items():
                with pytest.raises(ValueError):
                    await engine.generate(request)
                assert await engine.health(), what
            outs = await asyncio.gather(*good)
            later = await engine.generate(sampled("c", prompt, top_k=vocab))  # top_k == vocab: allowed
            assert await engine.health()
            return outs, later
        finally:
            await engine.shutdown()

    outs, later = run(body())
    for got, ref in zip(outs, want, strict=True):
        assert got.finish_reason == "length" and got.output_ids == ref.output_ids
    assert later.finish_reason == "length" and len(later.output_ids) == 24


def test_sampling_params_refuse_non_finite_and_out_of_range_values():
    for kw, needle in [
        (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
        (dict(top_p=math.nan), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"),
        (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(stop_token_ids=(-1,)), "stop"),
        (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(ignore_eos="no"), "ignore_eos"),
    ]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**{"max_new_tokens": 4, **kw})
    with pytest.raises(ValueError, match="integers"):
        GenerationRequest("r", (1, 2.0), SamplingParams(max_new_tokens=1))


def test_a_row_that_fails_while_decoding_fails_only_its_request(tok, prompt):
    """Rows the sampler refuses, or that make it raise, are narrowed down and failed alone; the good rows
    of the same step continue, and the engine stays healthy."""
    from rollers.engine import RequestError

    model = spiced_tiny()

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4)
        try:
            tasks = {rid: asyncio.create_task(engine.generate(sampled(rid, prompt, n=40, seed=i)))
                     for i, rid in enumerate(("good0", "refused", "raises", "good1"))}
            while not all(r in engine._by_id and len(engine._by_id[r].output.output_ids) >= 2 for r in tasks):
                await asyncio.sleep(0.005)
            refused, raises = engine._by_id["refused"], engine._by_id["raises"]
            refused.sampling = RowSampling(math.nan, 1.0, -1, refused.sampling.generator)
            raises.sampling = RowSampling(1.0, 1.0, -1, None)  # no generator: sampling raises AttributeError
            results = await asyncio.gather(*tasks.values(), return_exceptions=True)
            return dict(zip(tasks, results, strict=True)), await engine.health()
        finally:
            await engine.shutdown()

    results, healthy = run(body())
    assert healthy
    assert isinstance(results["refused"], RequestError) and "temperature" in str(results["refused"])
    assert isinstance(results["raises"], RequestError)
    for rid in ("good0", "good1"):
        assert results[rid].finish_reason == "length" and len(results[rid].output_ids) == 40


def test_context_limit_truncates_the_response(tok, prompt):
    """prompt + max_new_tokens beyond max_seq_len: the response stops at the limit, finish_reason=length
    (it used to be refused), and its tokens are the ones an unlimited engine gives."""
    model = spiced_tiny()
    room = 3

    async def body():
        limited = TorchEngine(model, tok, max_batch_slots=2, max_seq_len=len(prompt) + room)
        free = TorchEngine(model, tok, max_batch_slots=2)
        try:
            return (await limited.generate(sampled("x", prompt, n=10)),
                    await free.generate(sampled("x", prompt, n=10)))
        finally:
            await limited.shutdown()
            await free.shutdown()

    cut, full = run(body())
    assert cut.finish_reason == "length" and cut.output_ids == full.output_ids[:room]


def test_context_length_of_a_config():
    from rollers.model_limits import context_length

    model = spiced_tiny()
    assert context_length(model.config) == model.config.max_position_embeddings == 512
    assert TorchEngine(model, [2]).max_seq_len == 512
    config = type(model.config)(max_position_embeddings=4096, sliding_window=1024, use_sliding_window=True)
    assert context_length(config) == 1024
    assert torch.is_tensor(model.get_output_embeddings().weight)
