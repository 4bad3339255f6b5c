"""The SGLang HTTP path vs the in-process torch engine: generation throughput and weight-sync time.

The same requests (``--num-requests`` prompts, ``--max-new-tokens`` each, ``ignore_eos``, T=1, seeded)
run through (a) an in-process ``TorchEngine`` and (b) ``SGLangEngine`` talking to our torch engine behind
SGLang's API in a subprocess (``rollers.sglang_server``, launched by ``SGLangLauncher``), once with
``/generate`` answers and once streamed (SSE). Both engines get ``--slots`` batch slots and ``--threads``
torch threads. Then one weight sync through the HTTP path: pause → ``load_weights`` (this process is
rank 0 of a gloo group; one broadcast per tensor through ``/update_weights_from_distributed``) → flush
→ continue, for every parameter of the model.

Final line: ``RESULT inproc_tok_s=… http_tok_s=… http_stream_tok_s=… weight_sync_s=… weight_sync_mb_s=…``.

    .venv/bin/python bench/sglang_api_bench.py            # SmolLM2-135M, 32 requests x 64 tokens
    .venv/bin/python bench/sglang_api_bench.py --quick    # 8 requests x 16 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import time

from common.env import set_torch_threads, setup_process_env
from common.models import ModelConfig, load_model, load_tokenizer
from rollers.engine import Engine, GenerationRequest, SamplingParams
from rollers.sglang_engine import SGLangEngine
from rollers.sglang_launcher import SGLangLauncher
from rollers.torch_engine import TorchEngine
from rollers.weight_update import paused_update


def make_requests(num: int, max_new_tokens: int) -> list[GenerationRequest]:
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8][: 3 + i % 6] for i in range(num)]
    return [GenerationRequest(f"bench-{i}", tuple(p), SamplingParams(max_new_tokens=max_new_tokens, seed=i,
                                                                      ignore_eos=True))
            for i, p in enumerate(prompts)]


async def tokens_per_s(engine: Engine, requests: list[GenerationRequest], stream: bool) -> float:
    async def one(request):
        if not stream:
            return await engine.generate(request)
        last = None
        async for snapshot in engine.stream(request):
            last = snapshot
        return last

    started = time.perf_counter()
    outs = await asyncio.gather(*(one(r) for r in requests))
    elapsed = time.perf_counter() - started
    assert all(o.finish_reason == "length" for o in outs)
    return sum(len(o.output_ids) for o in outs) / elapsed


async def main(args) -> dict[str, float]:
    model_cfg = ModelConfig(path=args.model)
    model = load_model(model_cfg)
    requests = make_requests(args.num_requests, args.max_new_tokens)
    results = {}
    local = TorchEngine(model, load_tokenizer(model_cfg), max_batch_slots=args.slots)
    try:
        await tokens_per_s(local, requests[:2], stream=False)  # warm-up
        results["inproc_tok_s"] = await tokens_per_s(local, requests, stream=False)
    finally:
        await local.shutdown()
    launcher = SGLangLauncher("torch", model_cfg, max_batch_slots=args.slots, num_threads=args.threads,
                              startup_timeout_s=300)
    client = SGLangEngine(await launcher.start(), on_shutdown=launcher.stop, group_timeout_s=600)
    try:
        await client.connect()
        await tokens_per_s(client, requests[:2], stream=False)
        results["http_tok_s"] = await tokens_per_s(client, requests, stream=False)
        results["http_stream_tok_s"] = await tokens_per_s(client, requests, stream=True)
        weights = [(n, p.detach()) for n, p in model.named_parameters()]
        size_mb = sum(p.numel() * p.element_size() for _, p in weights) / 1e6
        version = await client.get_weight_version() + 1
        started = time.perf_counter()
        await paused_update(client, lambda: client.load_weights(weights, version), "abort")
        results["weight_sync_s"] = time.perf_counter() - started
        results["weight_sync_mb_s"] = size_mb / results["weight_sync_s"]
    finally:
        await client.shutdown()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 requests x 16 tokens")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.max_new_tokens = 8, 16
    setup_process_env()
    set_torch_threads(args.threads)
    results = asyncio.run(main(args))
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))
