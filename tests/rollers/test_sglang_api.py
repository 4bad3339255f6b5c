"""SGLangEngine (client) against an SGLang-API server over real HTTP, every endpoint, streaming and not.

The ``served`` fixture launches our torch engine behind SGLang's API in a subprocess (tiny model); its
``sglang`` parameter (``gpu``) runs the same client suite against a real SGLang server where one exists.
Tests that compare with an in-process ``TorchEngine`` or probe our server's input checks are torch-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import aiohttp
import pytest
import torch

from checkpointengine import broadcast as bc
from common import schema
from common.models import ModelConfig, load_model, load_tokenizer
from rollers import sglang_protocol as proto
from rollers.config import RolloutConfig
from rollers.engine import EngineError, GenerationRequest, SamplingParams
from rollers.sglang_engine import SGLangEngine
from rollers.sglang_launcher import SGLangLauncher
from rollers.weight_update import paused_update
from tests.listening import is_loopback, listening_sockets
from tests.rollers.engine_helpers import TIMEOUT_S, run

MAX_BODY_BYTES = 1 << 20


@dataclass
class Served:
    url: str
    kind: str
    model: ModelConfig


def launch_served(request, kind: str) -> Served:
    """Start an SGLang-API server of ``kind`` (``torch``: ours with the tiny model; ``sglang``: a real one with
    SmolLM2, skipped where SGLang is not installed), stopped by ``request``'s finalizer; its ``Served``."""
    if kind == "torch":
        model = ModelConfig(path="tiny")
        launcher = SGLangLauncher("torch", model, max_batch_slots=8, startup_timeout_s=TIMEOUT_S,
                                  extra_args=("--max-body-bytes", str(MAX_BODY_BYTES)))
    else:
        if importlib.util.find_spec("sglang") is None:
            pytest.skip("SGLang is not installed on this GPU machine (pip install 'sglang>=0.5,<0.6')")
        model = ModelConfig(path="smollm2-135m-instruct")
        launcher = SGLangLauncher("sglang", model, mem_fraction=0.3, startup_timeout_s=600)
    request.addfinalizer(lambda: asyncio.run(launcher.stop()))
    url = asyncio.run(launcher.start())
    return Served(url, kind, model)


@pytest.fixture(scope="module", params=["torch", pytest.param("sglang", marks=pytest.mark.gpu)])
def served(request):
    return launch_served(request, request.param)


@pytest.fixture
def torch_only(served):
    if served.kind != "torch":
        pytest.skip("compares with our in-process torch engine / probes our server's input checks")
    return served



@contextlib.asynccontextmanager
async def connected(url: str, **kwargs):
    client = SGLangEngine(url, **kwargs)
    try:
        await client.connect(timeout_s=30)
        yield client
    finally:
        await client.shutdown()


def _request(rid: str, n: int = 8, seed: int | None = 1, temperature: float = 1.0, **kw) -> GenerationRequest:
    return GenerationRequest(rid, (1, 5, 6, 7, 8), SamplingParams(max_new_tokens=n, temperature=temperature,
                                                                   seed=seed, **kw))


def _perturbed(model_cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The model's parameters (tied ones once) plus seeded noise: a known new set of weights."""
    gen = torch.Generator().manual_seed(seed)
    model = load_model(model_cfg)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


async def _push(client: SGLangEngine, weights: dict[str, torch.Tensor], mode: str = "abort") -> int:
    version = await client.get_weight_version() + 1
    await paused_update(client, lambda: client.load_weights(weights.items(), version), mode)
    return version


async def _reference(model_cfg: ModelConfig, weights: dict[str, torch.Tensor] | None, requests):
    """Outputs of an in-process TorchEngine holding ``weights``."""
    from rollers.torch_engine import TorchEngine

    model = load_model(model_cfg)
    if weights is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
    engine = TorchEngine(model, load_tokenizer(model_cfg), max_batch_slots=4)
    try:
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.shutdown()


# ------------------------------------------------------------------------------------- generation


def test_generate_and_stream_agree(served):
    async def main():
        async with connected(served.url) as client:
            # Seeded sampling on our engine; greedy on real SGLang, whose seeded GPU sampling need not repeat.
            req = _request("agree", n=12, ignore_eos=True, temperature=1.0 if served.kind == "torch" else 0.0)
            out = await client.generate(req)
            events = [o async for o in client.stream(req)]
        assert out.finish_reason == "length" and len(out.output_ids) == 12 and out.prompt_tokens == 5
        assert all(lp <= 0 for lp in out.output_log_probs)
        assert events[-1].output_ids == out.output_ids and events[-1].finish_reason == "length"
        assert events[-1].output_log_probs == pytest.approx(out.output_log_probs, abs=1e-3)
        sizes = [len(e.output_ids) for e in events]
        assert sizes == sorted(sizes) and all(e.finish_reason is None for e in events[:-1])
    run(main())


def test_stream_lines_longer_than_the_limit_fail_clearly(served):
    async def main():
        async with connected(served.url, max_event_bytes=1500) as client:
            with pytest.raises(EngineError, match="stream of 'long' failed"):
                _ = [o async for o in client.stream(_request("long", n=200, ignore_eos=True))]
            assert await client.health()

    run(main())


def test_raw_answer_fields_and_sse_framing(served):
    temperature = 1.0 if served.kind == "torch" else 0.0
    body = {"input_ids": [1, 5, 6], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 5, "temperature": temperature}}

    async def main():
        async with aiohttp.ClientSession() as http:
            async with http.post(served.url + "/generate", json=body) as r:
                assert r.status == 200
                answer = await r.json()
            async with http.post(served.url + "/generate", json=dict(body, stream=True)) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                text = await r.text()
        return answer, text

    answer, text = run(main())
    meta = answer["meta_info"]
    assert len(answer["output_ids"]) == 4 and meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 3
    assert meta["finish_reason"]["type"] == "length" and isinstance(meta["weight_version"], str)
    logprob, token_id, _text = meta["output_token_logprobs"][0]
    assert token_id == answer["output_ids"][0] and logprob <= 0
    events = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["output_ids"] == answer["output_ids"] and last["meta_info"]["finish_reason"]["type"] == "length"


def test_greedy_over_http_equals_in_process_engine(torch_only):
    weights = _perturbed(torch_only.model, seed=101)
    requests = [_request(f"g{i}", n=10, seed=None, temperature=0.0) for i in range(3)]

    async def main():
        async with connected(torch_only.url) as client:
            await _push(client, weights)
            return await asyncio.gather(*(client.generate(r) for r in requests))

    served_outs = run(main())
    reference = run(_reference(torch_only.model, weights, requests))
    for got, want in zip(served_outs, reference, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_log_probs == pytest.approx(want.output_log_probs, abs=1e-4)


# ------------------------------------------------------------------------------------ control plane


def test_health_model_info_and_weight_version(served):
    async def main():
        async with connected(served.url) as client:
            assert await client.health()
            info = await client.get_model_info()
            version = await client.get_weight_version()
            async with aiohttp.ClientSession() as http:
                async with http.get(served.url + "/health_generate") as r:
                    assert r.status == 200
        return info, version

    info, version = run(main())
    assert info["is_generation"] is True and info["weight_version"] == str(version)


def test_pause_abort_returns_partial_output_and_continue_serves_again(served):
    async def main():
        async with connected(served.url) as client:
            started = asyncio.Event()

            async def consume():
                last = None
                async for out in client.stream(_request("abort-me", n=400, ignore_eos=True)):
                    last = out
                    if len(out.output_ids) >= 2:
                        started.set()
                return last

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 30)
            await client.pause("abort")
            aborted = await task
            await client.resume()
            after = await client.generate(_request("after-abort", n=3, ignore_eos=True))
        assert aborted.finish_reason == "abort" and 2 <= len(aborted.output_ids) < 400
        assert after.finish_reason == "length"

    run(main())


def test_flush_refused_while_requests_run_then_retried_until_drained(served):
    async def main():
        async with connected(served.url, max_retries=2, backoff_s=0.01, max_backoff_s=0.02) as client:
            started = asyncio.Event()

            async def consume(n):
                async for out in client.stream(_request(f"flush-{n}", n=n, ignore_eos=True)):
                    if out.output_ids:
                        started.set()
                return out

            kept = asyncio.create_task(consume(300))
            await asyncio.wait_for(started.wait(), 30)
            await client.pause("in_place")  # the request keeps its cache: flush must be refused
            with pytest.raises(EngineError, match="HTTP 400"):
                await client.flush_cache()
            with pytest.raises(EngineError, match="still refused after 3 attempts"):
                await client.flush_cache_with_retry()
            await client.resume()
            assert (await kept).finish_reason == "length"
            started.clear()
            short = asyncio.create_task(consume(40))
            await asyncio.wait_for(started.wait(), 30)
            patient = SGLangEngine(served.url, max_retries=200, backoff_s=0.01, max_backoff_s=0.05)
            try:
                await patient.flush_cache_with_retry()  # answers 400 until the request drained
            finally:
                await patient.shutdown()
            assert (await short).finish_reason == "length"

    run(main())


def test_weight_update_in_flight_keeps_every_request(served):
    """pause(in_place) → update → continue while requests stream: none lost, later tokens are new."""
    weights = _perturbed(served.model, seed=202) if served.kind == "torch" else _perturbed(served.model, seed=0)
    num_tokens = 120

    async def main():
        async with connected(served.url) as client:
            old = await client.get_weight_version()
            progressed = [asyncio.Event() for _ in range(4)]

            async def consume(i):
                last = None
                async for out in client.stream(_request(f"inflight-{i}", n=num_tokens, seed=i, ignore_eos=True)):
                    last = out
                    if len(out.output_ids) >= 3:
                        progressed[i].set()
                return last

            tasks = [asyncio.create_task(consume(i)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 30)
            new = await _push(client, weights, mode="in_place")
            outs = await asyncio.gather(*tasks)
            fresh = await client.generate(_request("after-update", n=5, ignore_eos=True))
            return old, new, outs, fresh, client.weight_version

    old, new, outs, fresh, seen = run(main())
    assert new == old + 1 and seen == new
    for out in outs:
        assert out.finish_reason == "length" and len(out.output_ids) == num_tokens
        versions = out.weight_versions
        assert versions[0] == old and versions[-1] == new and versions == sorted(versions)
        switch = versions.index(new)
        assert switch >= 3 and all(v == new for v in versions[switch:])
    assert fresh.weight_versions == [new] * 5


def test_update_without_pause_drains_in_flight_requests_first(torch_only):
    """SGLang's writer lock: an update on an unpaused server waits for running requests (they finish on
    the old weights), holds new ones back, then loads; no request mixes versions."""
    weights = _perturbed(torch_only.model, seed=606)

    async def main():
        async with connected(torch_only.url) as client:
            old = await client.get_weight_version()
            progressed = [asyncio.Event() for _ in range(2)]

            async def consume(i, n):
                last = None
                async for out in client.stream(_request(f"drain-{i}", n=n, seed=i, ignore_eos=True)):
                    last = out
                    if i < 2 and len(out.output_ids) >= 2:
                        progressed[i].set()
                return last

            running = [asyncio.create_task(consume(i, 60)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 30)
            update = asyncio.create_task(client.load_weights(weights.items(), old + 1))
            await asyncio.sleep(0.05)
            late = asyncio.create_task(consume(2, 10))
            await update
            return old, await asyncio.gather(*running), await late

    old, running, late = run(main())
    for out in running:
        assert out.finish_reason == "length" and out.weight_versions == [old] * 60
    assert late.finish_reason == "length" and len(set(late.weight_versions)) == 1


def test_trainer_path_flattened_bucket_broadcast(torch_only):
    """The checkpoint-engine path: this process is rank 0 of SGLang's group and broadcasts a
    ``flattened_bucket``; the server (rank_offset 1) loads it and commits the version."""
    weights = _perturbed(torch_only.model, seed=303)
    names = list(weights)
    requests = [_request("bucket", n=8, seed=None, temperature=0.0)]

    async def main():
        async with connected(torch_only.url) as client:
            name = "trainer-bucket"
            store = bc.create_sender_store("127.0.0.1", 0, 2, 60)
            join = asyncio.create_task(asyncio.to_thread(bc.create_sender_group, store, 2, name, "gloo", 60))
            await client.init_weights_update_group("127.0.0.1", store.port, 1, 2, name, "gloo")
            group = await join
            version = await client.get_weight_version() + 1
            try:
                async def apply():
                    update = asyncio.create_task(client.update_weights_from_distributed(
                        names, [proto.dtype_to_sglang(weights[n].dtype) for n in names],
                        [list(weights[n].shape) for n in names], version, group_name=name,
                        load_format=proto.FLATTENED_BUCKET))
                    await asyncio.to_thread(proto.send_weights, [(n, weights[n]) for n in names], group,
                                            proto.FLATTENED_BUCKET)
                    await update

                await paused_update(client, apply, "abort")
                assert await client.get_weight_version() == version
                outs = [await client.generate(r) for r in requests]
            finally:
                await client.destroy_weights_update_group(name)
                bc.destroy_group(group)
            return outs

    outs = run(main())
    want = run(_reference(torch_only.model, weights, requests))
    assert outs[0].output_ids == want[0].output_ids


def test_update_from_disk_and_failed_update_keeps_version(torch_only, tmp_path):
    from safetensors.torch import save_file

    weights = _perturbed(torch_only.model, seed=404)
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "model.safetensors")
    requests = [_request("disk", n=8, seed=None, temperature=0.0)]

    async def main():
        async with connected(torch_only.url) as client:
            version = await client.get_weight_version() + 1
            await paused_update(client, lambda: client.update_weights_from_disk(str(tmp_path), version))
            assert await client.get_weight_version() == version
            outs = [await client.generate(r) for r in requests]
            bad = {"no.such.tensor": torch.zeros(2)}
            with pytest.raises(EngineError, match="no.such.tensor"):
                await paused_update(client, lambda: client.load_weights(bad.items(), version + 1))
            assert await client.get_weight_version() == version  # the old version stays
            assert (await client.generate(requests[0])).output_ids == outs[0].output_ids
            await _push(client, weights)  # a new group after the failed one: updates still work
            return outs

    outs = run(main())
    assert outs[0].output_ids == run(_reference(torch_only.model, weights, requests))[0].output_ids


def test_weight_update_with_retract_flushes_and_continues(torch_only):
    weights = _perturbed(torch_only.model, seed=505)

    async def main():
        async with connected(torch_only.url, max_retries=2, backoff_s=0.01) as client:
            started = asyncio.Event()

            async def consume():
                async for out in client.stream(_request("retract", n=200, ignore_eos=True)):
                    if out.output_ids:
                        started.set()
                return out

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 30)
            try:
                new = await _push(client, weights, mode="retract")
            finally:
                out = await task
            assert out.finish_reason == "length" and out.weight_versions[-1] == new

    run(main())


# --------------------------------------------------------------------------------- bad requests


def test_malformed_requests_get_400_and_the_server_keeps_serving(torch_only):
    url = torch_only.url
    cases = [
        ("/generate", b"{not json", "not valid JSON"),
        ("/generate", b"[1, 2]", "must be a JSON object"),
        ("/generate", b"[" * 100_000, "not valid JSON"),
        ("/generate", json.dumps({"input_ids": [1], "bogus": 1}).encode(), "unknown"),
        ("/generate", json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}).encode(),
         "max_new_tokens must be >= 1"),
        ("/generate", json.dumps({"input_ids": [10**6]}).encode(), "outside the vocabulary"),
        ("/generate", json.dumps({"input_ids": [1] * (MAX_BODY_BYTES // 2)}).encode(), "exceeds the limit"),
        ("/pause_generation", json.dumps({"mode": "sideways"}).encode(), "mode must be one of"),
        ("/init_weights_update_group", json.dumps({"master_address": "10.1.2.3", "master_port": 1234,
                                                   "rank_offset": 1, "world_size": 2, "backend": "gloo"}).encode(),
         "not a loopback address"),
        ("/init_weights_update_group", json.dumps({"master_address": "127.0.0.1", "master_port": 1234,
                                                   "rank_offset": 1, "world_size": 2}).encode(), "backend must be"),
        ("/update_weights_from_distributed", json.dumps({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                                         "group_name": "nope"}).encode(), "not initialised"),
        ("/update_weights_from_distributed", json.dumps({"names": ["a"], "dtypes": ["float32"]}).encode(),
         "missing field"),
        ("/update_weights_from_disk", json.dumps({"model_path": "/nonexistent"}).encode(), "no *.safetensors"),
    ]

    async def main():
        async with aiohttp.ClientSession() as http:
            for path, data, needle in cases:
                async with http.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    body = await r.json()
                    assert r.status == 400, (path, body)
                    assert body["success"] is False and needle in body["message"], (path, needle, body)
            async with http.post(url + "/flush_cache", params={"timeout": "soon"}) as r:
                assert r.status == 400
        async with connected(url) as client:
            assert await client.health()
            return await client.generate(_request("still-serving", n=3, ignore_eos=True))

    assert run(main()).finish_reason == "length"


def test_client_rejects_bad_arguments_before_sending(served):
    async def main():
        client = SGLangEngine(served.url)
        try:
            with pytest.raises(ValueError, match="pause mode"):
                await client.pause("sideways")
            with pytest.raises(ValueError, match="must increase"):
                await client.load_weights([("x", torch.zeros(1))], 0)
        finally:
            await client.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            await client.generate(_request("closed"))

    run(main())
    with pytest.raises(ValueError, match="http"):
        SGLangEngine("127.0.0.1:1")


def test_client_against_an_older_sglang_api(caplog):
    """An older server (stub): no ``/model_info``, no ``/begin_weight_update``, version ``"default"``,
    and ``/flush_cache`` answering 400 twice while aborted requests drain: the client falls back, retries,
    and completes pause → update → flush → continue. After a ``retract`` pause a refused flush is not
    retried (retracted requests wait until the resume): logged, and the update completes."""
    from aiohttp import web

    calls: list[str] = []
    flush_refusals = [2]

    async def handle(request: web.Request) -> web.Response:
        calls.append(request.path)
        if request.path == "/flush_cache" and flush_refusals[0] > 0:
            flush_refusals[0] -= 1
            return web.Response(status=400, text="Cache not flushed: 1 running request\n")
        if request.path == "/get_model_info":
            return web.json_response({"weight_version": "default", "is_generation": True})
        if request.path == "/update_weights_from_disk":
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        return web.json_response({"status": "ok"}) if request.path != "/health" else web.Response()

    async def main():
        app = web.Application()
        for path in ("/health", "/get_model_info"):
            app.router.add_get(path, handle)
        for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk"):
            app.router.add_post(path, handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with connected(f"http://127.0.0.1:{runner.addresses[0][1]}", backoff_s=0.01) as client:
                assert client.weight_version == 0  # SGLang's "default"
                await paused_update(client, lambda: client.update_weights_from_disk("/ckpt", 1), "abort")
                assert client.weight_version == 1
                flush_refusals[0] = 1
                await paused_update(client, lambda: client.update_weights_from_disk("/ckpt", 2), "retract")
                assert client.weight_version == 2
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="rollers.weight_update"):
        run(main())
    # (/model_info and /begin_weight_update got aiohttp's 404 before reaching ``handle``.)
    update = ["/pause_generation", "/update_weights_from_disk"]
    assert calls == ["/health", "/get_model_info", *update, "/flush_cache", "/flush_cache", "/flush_cache",
                     "/continue_generation", *update, "/flush_cache", "/continue_generation"]
    assert "prefix cache not flushed after a retract pause" in caplog.text


def test_load_weights_group_listens_on_loopback_only(torch_only):
    """``load_weights`` forms its broadcast group with ``checkpointengine.broadcast`` (one implementation of
    SGLang's group); the rendezvous store it hosts listens on 127.0.0.1 only, never on every interface."""
    weights = _perturbed(torch_only.model, seed=606)

    async def main():
        async with connected(torch_only.url) as client:
            before = set(listening_sockets(os.getpid()))
            await _push(client, weights)
            group = client._own_group[1]  # kept for the next update: its store is still listening
            opened = {a for a in set(listening_sockets(os.getpid())) - before if a.endswith(f":{group.master_port}")}
            assert opened and all(is_loopback(a) for a in opened), opened

    run(main())


# ------------------------------------------------------------------------------------ agent loop over HTTP


def test_agent_loop_drives_the_server_with_input_ids(served):
    """The same multi-turn loop over ``/generate`` with ``input_ids``: trajectories equal those of the
    in-process torch engine (same model and per-turn seeds), environment tokens masked out."""
    from rollers.rewards import tiny_repeat_reward
    from rollers.roller import GroupResult, Roller
    from rollers.torch_engine import TorchEngine
    from tests.rollers.engine_helpers import LocalGroupChannel
    from tests.rollers.test_agent_loop import ENV, make_group, short_turn_stops

    tok = load_tokenizer(served.model)
    rollout = RolloutConfig(n=2, max_response_length=32, seed=3, environment=ENV + "scripted_turns")

    async def roll(engine):
        roller = Roller(engine, tok, tiny_repeat_reward, rollout, LocalGroupChannel(), poll_timeout_s=0.05)
        if served.kind == "torch":
            roller.agent.stop_ids = short_turn_stops(tok)
        return await roller.process_group(make_group(tok, 0, n=2)), roller.stats()

    # Known weights on the server first: earlier tests of this module push other weights to the same server.
    weights = _perturbed(served.model, seed=303)

    async def over_http():
        async with connected(served.url) as client:
            await _push(client, weights)
            return await roll(client)

    result, stats = run(over_http())
    assert isinstance(result, GroupResult) and stats["num_turns"] >= 2
    mask = result.fields[schema.RESPONSE_MASK]
    log_probs = result.fields[schema.ROLLOUT_LOG_PROBS]
    assert torch.all(log_probs[mask == 0] == 0) and torch.all(log_probs[mask == 1] < 0)
    lengths = result.fields[schema.RESPONSE_LENGTH].tolist()
    assert any(0 in mask[row, :length].tolist() for row, length in enumerate(lengths))  # environment tokens inside
    if served.kind != "torch":
        return

    async def in_process():
        model = load_model(served.model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        engine = TorchEngine(model, tok, max_batch_slots=4)
        try:
            return await roll(engine)
        finally:
            await engine.shutdown()

    reference, _ = run(in_process())
    for key in (schema.RESPONSES, schema.RESPONSE_MASK, schema.TOKEN_LEVEL_SCORES):
        assert torch.equal(result.fields[key], reference.fields[key]), key
    torch.testing.assert_close(log_probs, reference.fields[schema.ROLLOUT_LOG_PROBS], atol=1e-4, rtol=0)
