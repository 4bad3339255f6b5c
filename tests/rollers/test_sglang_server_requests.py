"""Hostile requests to our SGLang-API server (``rollers.sglang_server``) over real HTTP (issue #12): each
bad request gets a 400 naming what is wrong while good requests in flight are served, ``/health`` stays
200, and nothing a request says can make the server wait forever."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from common.models import ModelConfig, load_model, load_tokenizer
from rollers.engine import GenerationRequest, SamplingParams
from rollers.sglang_engine import SGLangEngine
from rollers.sglang_launcher import SGLangLauncher
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import TIMEOUT_S, run

MODEL = ModelConfig(path="tiny")  # vocabulary < 100 words, context length 512
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def url(request):
    launcher = SGLangLauncher("torch", MODEL, max_batch_slots=8, startup_timeout_s=TIMEOUT_S)
    request.addfinalizer(lambda: asyncio.run(launcher.stop()))
    return asyncio.run(launcher.start())


def _greedy(rid: str, n: int) -> GenerationRequest:
    return GenerationRequest(rid, tuple(PROMPT), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def _generate(sampling: dict, input_ids=PROMPT) -> str:
    return json.dumps({"input_ids": input_ids, "sampling_params": sampling})


# Raw bodies: Python's json (the server's parser) reads the non-standard literals NaN and Infinity.
BAD_GENERATE = [
    (_generate({"top_k": 10**6}), "top_k=1000000 exceeds the vocabulary"),  # it used to kill the engine
    ('{"input_ids": [1, 5], "sampling_params": {"temperature": NaN}}', "temperature"),
    ('{"input_ids": [1, 5], "sampling_params": {"temperature": Infinity}}', "temperature"),
    ('{"input_ids": [1, 5], "sampling_params": {"top_p": NaN}}', "top_p"),
    ('{"input_ids": [1, 5], "sampling_params": {"max_new_tokens": Infinity}}', "max_new_tokens"),
    (_generate({"top_k": 10**6, "max_new_tokens": 2}) [:-1] + ', "stream": true}', "top_k"),
    (_generate({"sampling_seed": 2**70}), "seed"),
    (_generate({"stop_token_ids": [10**6]}), "stop_token_ids"),
    (_generate({"stop_token_ids": [-1]}), "stop_token_ids"),
    (_generate({"max_new_tokens": "5"}), "max_new_tokens"),
    (_generate({"temperature": "hot"}), "temperature"),
    (_generate({}, input_ids=[]), "input_ids is empty"),
    (_generate({}, input_ids=[1] * 512), "no room for a response"),
    (_generate({}, input_ids=[-1]), "outside the vocabulary"),
]
BAD_CONTROL = [
    ("/destroy_weights_update_group", {"group_name": [1]}, "group_name"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                          "group_name": {"x": 1}}, "group_name"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
                                    "world_size": 2, "backend": "gloo", "group_name": ["g"]}, "group_name"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
]


def test_bad_requests_between_good_ones_get_400_and_the_good_ones_are_served(url):
    async def main():
        async with aiohttp.ClientSession() as http:
            client = SGLangEngine(url)
            await client.connect(timeout_s=30)
            try:
                progressed = asyncio.Event()

                async def consume(rid):
                    last = None
                    async for last in client.stream(_greedy(rid, 60)):
                        if len(last.output_ids) >= 2:
                            progressed.set()
                    return last

                good = [asyncio.create_task(consume(f"good{i}")) for i in range(2)]
                await asyncio.wait_for(progressed.wait(), 30)
                for body, needle in BAD_GENERATE:
                    async with http.post(url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"}) as r:
                        answer = await r.json()
                        assert r.status == 400 and needle in answer["message"], (body[:80], answer)
                    async with http.get(url + "/health") as r:
                        assert r.status == 200, body[:80]
                for path, body, needle in BAD_CONTROL:
                    async with http.post(url + path, json=body) as r:
                        answer = await r.json()
                        assert r.status == 400 and needle in answer["message"], (path, answer)
                for timeout in ("nan", "inf", "-1", "1e12"):
                    started = time.monotonic()
                    async with http.post(url + "/flush_cache", params={"timeout": timeout}) as r:
                        assert r.status == 400 and "timeout must be" in await r.text(), timeout
                    assert time.monotonic() - started < 5
                outs = await asyncio.gather(*good)
                # A prompt near the context limit: the response is cut at 512 tokens, finish_reason=length.
                near = GenerationRequest("near", tuple([1] * 509), SamplingParams(max_new_tokens=10**6,
                                                                                  temperature=0.0, ignore_eos=True))
                cut = await client.generate(near)
                later = await client.generate(_greedy("later", 8))
                async with http.get(url + "/health") as r:
                    assert r.status == 200
                return outs, cut, later
            finally:
                await client.shutdown()

    outs, cut, later = run(main())
    want = run(_reference([_greedy("ref", 60)]))[0]
    for out in outs:
        assert out.finish_reason == "length" and out.output_ids == want.output_ids
    assert cut.finish_reason == "length" and len(cut.output_ids) == 3
    assert later.finish_reason == "length" and later.output_ids == want.output_ids[:8]


async def _reference(requests):
    engine = TorchEngine(load_model(MODEL), load_tokenizer(MODEL), max_batch_slots=4)
    try:
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.shutdown()


def test_control_endpoints_type_their_flags_and_answer_503_on_a_dead_engine(tmp_path):
    """In-process server: a weight-update flag given as the string "false" is refused (it used to read as
    true); pause/continue on a shut-down engine answer 503 with a message (they used to raise: HTTP 500)."""
    from safetensors.torch import save_file

    from rollers.sglang_server import SGLangServer

    model = load_model(MODEL)
    save_file({k: v.detach().clone() for k, v in model.named_parameters()}, tmp_path / "model.safetensors")

    async def main():
        engine = TorchEngine(model, load_tokenizer(MODEL), max_batch_slots=2)
        server = SGLangServer(engine, vocab_size=model.get_output_embeddings().weight.shape[0])
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for flag in ("flush_cache", "abort_all_requests", "torch_empty_cache"):
                    body = {"model_path": str(tmp_path), "weight_version": 1, flag: "false"}
                    async with http.post(base + "/update_weights_from_disk", json=body) as r:
                        answer = await r.json()
                        assert r.status == 400 and f"{flag} must be a boolean" in answer["message"], answer
                assert engine.weight_version == 0
                await engine.shutdown()
                for path in ("/pause_generation", "/continue_generation"):
                    async with http.post(base + path, json={}) as r:
                        assert r.status == 503 and "shut down" in (await r.json())["message"], path
        finally:
            await server.stop()

    run(main())


def test_generate_requests_beyond_max_queued_requests_get_503_and_the_rest_are_served():
    from rollers.sglang_server import SGLangServer

    model = load_model(MODEL)

    async def main():
        engine = TorchEngine(model, load_tokenizer(MODEL), max_batch_slots=2)
        server = SGLangServer(engine, vocab_size=model.get_output_embeddings().weight.shape[0],
                              max_queued_requests=1)
        base = f"http://127.0.0.1:{await server.start()}"
        client = SGLangEngine(base)
        try:
            progressed = asyncio.Event()

            async def consume():
                async for out in client.stream(_greedy("long", 200)):
                    if len(out.output_ids) >= 2:
                        progressed.set()
                return out

            long = asyncio.create_task(consume())
            await asyncio.wait_for(progressed.wait(), 30)
            async with aiohttp.ClientSession() as http:
                async with http.post(base + "/generate", data=_generate({"max_new_tokens": 2})) as r:
                    assert r.status == 503 and "queue is full" in (await r.json())["message"]
                async with http.get(base + "/health") as r:
                    assert r.status == 200
            assert (await long).finish_reason == "length"
            return await client.generate(_greedy("after", 3))
        finally:
            await client.shutdown()
            await server.stop()

    assert run(main()).finish_reason == "length"
