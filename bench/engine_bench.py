"""Torch engine vs Hugging Face ``generate``: useful (requested) tokens per second, same run, same requests.

SmolLM2-135M-Instruct, fp32, CPU (or one GPU with ``--device cuda``). Three workloads (issue #5):

* **long-tail**: 64 requests (``--quick``: 16), ``max_new_tokens`` drawn with a fixed seed, 80% in 16–32
  and 20% in 128–256, ``ignore_eos``, at most 8 in flight. HF ``generate`` runs them in batches of 8 in
  arrival order, each batch decoding to its longest request; the engine runs them with 8 slots.
* **uniform**: batch 8 and batch 32, 64 new tokens each (``--quick``: 32), ``ignore_eos``.

Both sides sample at temperature 1 over the full vocabulary (HF: ``do_sample=True, top_k=0, top_p=1``;
HF ignores EOS with ``min_new_tokens``). Useful tokens = the sum of the requests' ``max_new_tokens``.
Final line: ``RESULT engine_tok_s_longtail=… hf_tok_s_longtail=… engine_tok_s_b8=… hf_tok_s_b8=…
engine_tok_s_b32=… hf_tok_s_b32=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

import torch

from common.env import set_torch_threads, setup_process_env
from common.models import ModelConfig, apply_chat_template, load_model, load_tokenizer
from rollers.engine import GenerationRequest, SamplingParams
from rollers.torch_engine import TorchEngine

QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis in one paragraph.", "Write a haiku about rain.",
    "How many legs does a spider have?", "Give three tips for learning to code.", "What is 17 times 23?",
    "Describe the water cycle.", "Name five fruits that are red.", "Why is the sky blue?",
    "Summarise the plot of Hamlet.", "What does a CPU do?", "Translate 'good morning' into Spanish.",
)


def make_requests(tok, max_new: list[int]) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) pairs; prompts cycle through ``QUESTIONS``."""
    return [(apply_chat_template(tok, QUESTIONS[i % len(QUESTIONS)]), n) for i, n in enumerate(max_new)]


def long_tail_lengths(num: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(128, 256) if rng.random() < 0.2 else rng.randint(16, 32) for _ in range(num)]


def run_engine(model, tok, requests, slots: int) -> float:
    """Seconds for the engine to finish ``requests`` (all submitted at once, ``slots`` in flight)."""

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=slots, seed=0)
        try:
            start = time.perf_counter()
            outs = await asyncio.gather(*[
                engine.generate(GenerationRequest(f"r{i}", tuple(ids), SamplingParams(
                    max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True)))
                for i, (ids, n) in enumerate(requests)
            ])
            elapsed = time.perf_counter() - start
        finally:
            await engine.shutdown()
        assert [len(o.output_ids) for o in outs] == [n for _, n in requests]
        return elapsed

    return asyncio.run(body())


def run_hf(model, tok, requests, batch_size: int) -> float:
    """Seconds for HF ``generate`` on ``requests`` in arrival-order batches (left-padded, to the longest)."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        chunk = requests[first : first + batch_size]
        longest = max(n for _, n in chunk)
        enc = tok.pad({"input_ids": [ids for ids, _ in chunk]}, return_tensors="pt").to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
        assert out.shape[1] == enc["input_ids"].shape[1] + longest
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 long-tail requests, 32 uniform tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    setup_process_env(num_threads=args.threads)
    set_torch_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(path="smollm2-135m-instruct")
    tok = load_tokenizer(cfg)
    model = load_model(cfg, device=args.device)

    warm = make_requests(tok, [4, 4])
    run_engine(model, tok, warm, 2)
    run_hf(model, tok, warm, 2)

    results = {}
    tail = make_requests(tok, long_tail_lengths(16 if args.quick else 64))
    useful = sum(n for _, n in tail)
    results["engine_tok_s_longtail"] = useful / run_engine(model, tok, tail, 8)
    results["hf_tok_s_longtail"] = useful / run_hf(model, tok, tail, 8)
    print(f"long-tail: {len(tail)} requests, {useful} useful tokens: engine "
          f"{results['engine_tok_s_longtail']:.1f} tok/s, HF {results['hf_tok_s_longtail']:.1f} tok/s", flush=True)
    new_tokens = 32 if args.quick else 64
    for batch in (8, 32):
        reqs = make_requests(tok, [new_tokens] * batch)
        useful = batch * new_tokens
        results[f"engine_tok_s_b{batch}"] = useful / run_engine(model, tok, reqs, batch)
        results[f"hf_tok_s_b{batch}"] = useful / run_hf(model, tok, reqs, batch)
        print(f"uniform batch {batch} x {new_tokens}: engine {results[f'engine_tok_s_b{batch}']:.1f} tok/s, "
              f"HF {results[f'hf_tok_s_b{batch}']:.1f} tok/s", flush=True)
    print("RESULT " + " ".join(f"{k}={v:.1f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
