"""TorchEngine control plane: pause modes, weight loading across pauses, flush, cancel, failure, shutdown.

Every test that loads weights builds its own models (the tiny Llama re-drawn with std 0.2, see
``spiced_tiny``); "new weights" are the same architecture drawn from another seed.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from common.models import ModelConfig, apply_chat_template, load_tokenizer
from rollers.engine import EngineError, GenerationRequest, SamplingParams
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import run, spiced_tiny

MAX_NEW = 14




def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def greedy(rid: str, prompt_ids, max_new_tokens: int = MAX_NEW) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt_ids), SamplingParams(max_new_tokens=max_new_tokens, temperature=0))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="module")
def prompts(tok):
    return [apply_chat_template(tok, p) for p in ("repeat the word a b c", "say 1 2 3")]


@pytest.fixture(scope="module")
def new_weights():
    """A state_dict (both tied names included) of the same architecture with other values."""
    return {k: v.detach().clone() for k, v in spiced_tiny(seed=1).state_dict().items()}


@pytest.fixture(scope="module")
def new_model(new_weights):
    model = spiced_tiny()
    model.load_state_dict(new_weights)
    return model


async def _stream_until(engine, req, num_tokens: int, action):
    """Stream ``req``; run ``await action()`` once it has ``num_tokens`` tokens; return the final output."""
    acted = False
    last = None
    async for last in engine.stream(req):
        if not acted and len(last.output_ids) >= num_tokens:
            acted = True
            await action()
    assert acted, "the request finished before the action could run"
    return last


def test_abort_load_weights_resume_keeps_prefix(tok, prompts, new_weights, new_model):
    old = spiced_tiny()
    reference = hf_greedy(old, prompts[0], MAX_NEW)
    assert len(reference) == MAX_NEW  # no EOS in the window: the abort really cuts the request short

    async def body():
        engine = TorchEngine(old, tok, max_batch_slots=2)
        try:
            aborted = await _stream_until(engine, greedy("r", prompts[0]), 4, lambda: engine.pause("abort"))
            await engine.load_weights(new_weights.items(), weight_version=1)
            await engine.resume()
            k = len(aborted.output_ids)
            cont = await engine.generate(greedy("r", [*prompts[0], *aborted.output_ids], MAX_NEW - k))
            return aborted, cont
        finally:
            await engine.shutdown()

    aborted, cont = run(body())
    k = len(aborted.output_ids)
    assert aborted.finish_reason == "abort" and 4 <= k < MAX_NEW
    assert aborted.output_ids == reference[:k] and aborted.weight_versions == [0] * k
    assert cont.output_ids == hf_greedy(new_model, [*prompts[0], *reference[:k]], MAX_NEW - k)
    versions = aborted.weight_versions + cont.weight_versions
    assert versions == [0] * k + [1] * len(cont.output_ids) and {0, 1} == set(versions)


def test_retract_load_weights_resume_recomputes_under_new_weights(tok, prompts, new_weights, new_model):
    old = spiced_tiny()
    old_refs = [hf_greedy(old, p, MAX_NEW) for p in prompts]  # before the engine overwrites ``old``

    async def body():
        engine = TorchEngine(old, tok, max_batch_slots=2)

        async def update():
            await engine.pause("retract")
            await engine.load_weights(new_weights.items(), weight_version=1)
            await engine.resume()

        try:
            other = asyncio.create_task(engine.generate(greedy("b", prompts[1])))
            first = await _stream_until(engine, greedy("a", prompts[0]), 4, update)
            return [first, await other], engine.weight_version
        finally:
            await engine.shutdown()

    outs, version = run(body())
    assert version == 1
    for prompt, old_ref, out in zip(prompts, old_refs, outs, strict=True):
        k = out.weight_versions.count(0)
        assert out.finish_reason in ("stop", "length") and out.min_weight_version == 0
        assert out.weight_versions == [0] * k + [1] * (len(out.output_ids) - k)
        assert out.output_ids[:k] == old_ref[:k]
        # After the update the KV cache was recomputed: the rest is the new model's greedy continuation.
        assert out.output_ids[k:] == hf_greedy(new_model, [*prompt, *out.output_ids[:k]], MAX_NEW - k)
    assert outs[0].max_weight_version == 1 and outs[0].weight_versions.count(0) >= 4


def test_resume_steps_only_after_the_resumers_completion_callbacks(tok, prompts):
    """A weight update's reply to the controller (its Ray future completes in a done callback of the update's
    task) is not held behind the re-prefill that the update's resume() starts: between the update returning
    and its done callbacks the engine runs no forward."""

    async def body():
        engine = TorchEngine(spiced_tiny(), tok, max_batch_slots=2)
        seen = {}

        async def update():
            await engine.pause("retract")
            await asyncio.sleep(0.05)  # the weights' receive: the engine loop sees the pause and waits
            await engine.resume()
            return engine.stats()["num_forwards"]

        async def act():
            task = asyncio.create_task(update())
            task.add_done_callback(lambda t: seen.update(returned=t.result(),
                                                         at_callback=engine.stats()["num_forwards"]))
            await task

        try:
            out = await _stream_until(engine, greedy("a", prompts[0]), 4, act)
            return seen, out, engine.stats()["num_forwards"]
        finally:
            await engine.shutdown()

    seen, out, forwards = run(body())
    assert seen["at_callback"] == seen["returned"]
    assert forwards > seen["returned"] and len(out.output_ids) == MAX_NEW  # the engine did resume afterwards


def test_in_place_pause_keeps_kv_and_requests(tok, prompts, new_weights):
    model = spiced_tiny()
    reference = hf_greedy(model, prompts[0], MAX_NEW)

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2)
        try:
            async def pause_and_check():
                await engine.pause("in_place")
                stats = engine.stats()
                await asyncio.sleep(0.05)  # nothing decodes while paused
                assert engine.stats()["num_tokens_generated"] == stats["num_tokens_generated"]
                assert stats["num_running"] == 1
                await engine.resume()

            same = await _stream_until(engine, greedy("a", prompts[0]), 3, pause_and_check)

            async def update():
                await engine.pause("in_place")
                await engine.load_weights(new_weights.items(), weight_version=5)
                await engine.resume()

            updated = await _stream_until(engine, greedy("b", prompts[0]), 3, update)
            return same, updated
        finally:
            await engine.shutdown()

    same, updated = run(body())
    assert same.output_ids == reference and same.weight_versions == [0] * len(reference)
    k = updated.weight_versions.count(0)
    assert k >= 3 and updated.output_ids[:k] == reference[:k]
    assert updated.weight_versions == [0] * k + [5] * (len(updated.output_ids) - k)


def test_load_weights_validation_commits_nothing_on_error(tok, prompts, new_weights, new_model):
    model = spiced_tiny()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=1)
        try:
            with pytest.raises(EngineError, match="paused"):
                await engine.load_weights(new_weights.items(), weight_version=1)
            await engine.pause("abort")
            changed = ("model.norm.weight", new_weights["model.norm.weight"])
            with pytest.raises(KeyError, match="no.such.weight"):
                await engine.load_weights([changed, ("no.such.weight", torch.zeros(1))], weight_version=1)
            with pytest.raises(ValueError, match="shape"):
                await engine.load_weights([changed, ("lm_head.weight", torch.zeros(3, 3))], weight_version=1)
            with pytest.raises(ValueError, match="increase"):
                await engine.load_weights([changed], weight_version=0)
            for name, value in model.state_dict().items():
                assert torch.equal(value, before[name]), f"{name} changed by a failed load"
            assert engine.weight_version == 0
            # Tied embeddings: sending only lm_head.weight updates the shared tensor (and vice versa).
            rest = [(k, v) for k, v in new_weights.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")]
            await engine.load_weights([*rest, ("lm_head.weight", new_weights["lm_head.weight"])], weight_version=2)
            assert torch.equal(model.model.embed_tokens.weight, new_weights["model.embed_tokens.weight"])
            await engine.resume()
            return await engine.generate(greedy("r", prompts[1])), engine.weight_version
        finally:
            await engine.shutdown()

    out, version = run(body())
    assert version == 2 and out.weight_versions == [2] * len(out.output_ids)
    assert out.output_ids == hf_greedy(new_model, prompts[1], MAX_NEW)


def test_pause_modes_flush_and_queueing(tok, prompts):
    model = spiced_tiny()

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=1)
        try:
            with pytest.raises(ValueError, match="pause mode"):
                await engine.pause("sideways")
            running = asyncio.create_task(engine.generate(greedy("a", prompts[0], 30)))
            queued = asyncio.create_task(engine.generate(greedy("b", prompts[1])))  # waits: one slot only
            while engine.stats()["num_running"] == 0:  # bounded by run()'s timeout
                await asyncio.sleep(0.001)
            with pytest.raises(EngineError, match="flush_cache"):
                await engine.flush_cache()
            await engine.pause("in_place")  # kept with their KV: no flush
            with pytest.raises(EngineError, match="flush_cache"):
                await engine.flush_cache()
            await engine.pause("retract")  # kept without KV: the flush is allowed
            await engine.flush_cache()
            late = asyncio.create_task(engine.generate(greedy("c", prompts[1])))
            await asyncio.sleep(0.05)
            assert not (running.done() or queued.done() or late.done())
            await engine.resume()
            outs = await asyncio.gather(running, queued, late)
            await engine.flush_cache()  # idle: allowed
            again = await engine.generate(greedy("d", prompts[1]))
            return outs, again, await engine.health()
        finally:
            await engine.shutdown()

    (a, b, c), again, healthy = run(body())
    assert healthy
    assert a.output_ids == hf_greedy(model, prompts[0], 30)
    assert b.output_ids == c.output_ids == again.output_ids == hf_greedy(model, prompts[1], MAX_NEW)


def test_cancel_frees_the_slot_and_validation_errors(tok, prompts):
    model = spiced_tiny()

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=1, max_seq_len=64)
        try:
            with pytest.raises(ValueError, match="no room for a response within max_seq_len=64"):
                await engine.generate(greedy("long", [1] * 64, 1))
            with pytest.raises(ValueError, match="outside"):
                await engine.generate(greedy("bad", [1, 10_000]))
            task = asyncio.create_task(engine.generate(greedy("x", prompts[0], 40)))
            await asyncio.sleep(0.02)
            with pytest.raises(ValueError, match="already in flight"):
                await engine.generate(greedy("x", prompts[1]))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.stats()["num_requests_in_flight"] == 0
            return await engine.generate(greedy("y", prompts[1]))
        finally:
            await engine.shutdown()

    assert run(body()).output_ids == hf_greedy(model, prompts[1], MAX_NEW)


def test_failed_step_fails_requests_and_health(tok, prompts):
    model = spiced_tiny()

    def explode(*_args, **_kwargs):
        raise RuntimeError("boom")

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2)
        handle = model.register_forward_pre_hook(explode)
        try:
            with pytest.raises(EngineError, match="boom"):
                await engine.generate(greedy("r", prompts[0]))
            assert not await engine.health()
            with pytest.raises(EngineError, match="failed"):
                await engine.generate(greedy("s", prompts[0]))
        finally:
            handle.remove()
            await engine.shutdown()

    run(body())


def test_shutdown_aborts_requests_and_joins_the_task(tok, prompts):
    model = spiced_tiny()

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=1)
        assert await engine.health()
        running = asyncio.create_task(engine.generate(greedy("a", prompts[0], 40)))
        waiting = asyncio.create_task(engine.generate(greedy("b", prompts[1], 40)))
        await asyncio.sleep(0.02)
        decode_task = engine._task
        assert decode_task is not None and not decode_task.done()
        await engine.shutdown()
        await engine.shutdown()  # idempotent
        outs = await asyncio.gather(running, waiting)
        assert decode_task.done()
        assert [t.get_name() for t in asyncio.all_tasks() if t.get_name() == "torch-engine-decode"] == []
        assert not await engine.health()
        with pytest.raises(EngineError, match="shut down"):
            await engine.generate(greedy("c", prompts[0]))
        with pytest.raises(EngineError, match="shut down"):
            await engine.pause("abort")
        return outs

    running, waiting = run(body())
    assert running.finish_reason == "abort" and 0 < len(running.output_ids) < 40
    assert waiting.finish_reason == "abort" and waiting.output_ids == []


def _file_mapped(tensors, path) -> list[bool]:
    """Whether each tensor's first byte lies in a mapping of file ``path`` (``/proc/self/maps``)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return [any(low <= t.data_ptr() < high for low, high in ranges) for t in tensors]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_engine_weights_leave_the_file_mapping(tok, tmp_path):
    """Hugging Face maps a safetensors checkpoint's weights from the file; the engine copies them into memory
    of its own (its first ``load_weights`` would otherwise copy-on-write every page), keeping the Parameter
    objects (ties hold) and the values."""
    from transformers import AutoModelForCausalLM

    spiced_tiny().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    file = (tmp_path / "model.safetensors").resolve()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    assert all(_file_mapped(params, file)), "precondition: from_pretrained maps the weights from the file"
    engine = TorchEngine(model, tok, max_batch_slots=2)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any(_file_mapped(params, file))
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    run(engine.shutdown())
