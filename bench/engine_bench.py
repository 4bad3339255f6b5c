"""Torch engine vs Hugging Face ``generate``: useful (requested) tokens per second, same run, same requests.

SmolLM2-135M-Instruct, fp32, CPU (or one GPU with ``--device cuda``). Three workloads (issue #5):

* **long-tail**: 64 requests (``--quick``: the first 32 of them), ``max_new_tokens`` drawn with a fixed
  seed, 80% in 16–32 and 20% in 128–256, ``ignore_eos``, at most 8 in flight. HF ``generate`` runs them in
  batches of 8 in arrival order, each batch decoding to its longest request; the engine runs them with 8
  slots. The script prints the workload's structural bound on the ratio (``step_bound``: HF's decode
  steps over the engine's first-come-first-served makespan in steps, ``long_tail_bound``); 32 requests is
  the fewest whose bound matches the full workload's (16 would cap the ratio near 1.1×).
* **uniform**: batch 8 and batch 32, 64 new tokens each (``--quick``: 32), ``ignore_eos``.

Both sides sample at temperature 1 over the full vocabulary (HF: ``do_sample=True, top_k=0, top_p=1``;
HF ignores EOS with ``min_new_tokens``). Useful tokens = the sum of the requests' ``max_new_tokens``.
Each workload runs ``--reps`` times, engine and HF alternating in one process (so both see the same
machine load); tok/s are medians, ``ratio_*`` the median of the per-repetition ratios (min–max printed).
Final line: ``RESULT engine_tok_s_longtail=… hf_tok_s_longtail=… ratio_longtail=… step_bound_longtail=…
engine_tok_s_b8=… hf_tok_s_b8=… ratio_b8=… engine_tok_s_b32=… hf_tok_s_b32=… ratio_b32=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import os
import random
import statistics
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
    """The first ``num`` lengths of the long-tail stream (a prefix of the full workload's 64)."""
    rng = random.Random(seed)
    return [rng.randint(128, 256) if rng.random() < 0.2 else rng.randint(16, 32) for _ in range(num)]


def long_tail_bound(lengths: list[int], slots: int = 8) -> float:
    """HF's decode steps (arrival-order batches of ``slots``, each to its longest) over the engine's
    makespan in steps when each request holds one of ``slots`` from first come, first served: the
    ratio an engine reaches when a step costs the same at any occupancy (fewer busy slots cost a little
    less on CPU, so measured ratios can pass it somewhat)."""
    hf_steps = sum(max(lengths[i : i + slots]) for i in range(0, len(lengths), slots))
    free_at = [0] * slots
    for n in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return hf_steps / max(free_at)


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


def compare(results: dict, name: str, models: tuple, tok, requests, slots: int, reps: int) -> None:
    """Run ``requests`` ``reps`` times on the engine and on HF, alternating (who goes first alternates
    too); ``models`` is (the engine's, HF's). Store median tok/s and the median per-repetition ratio in
    ``results``, print each repetition."""
    useful = sum(n for _, n in requests)
    engine, hf = [], []
    for rep in range(reps):
        runs = [("engine", run_engine, models[0]), ("hf", run_hf, models[1])]
        for side, fn, model in runs if rep % 2 == 0 else runs[::-1]:
            (engine if side == "engine" else hf).append(useful / fn(model, tok, requests, slots))
        print(f"  {name} rep {rep + 1}: engine {engine[-1]:.1f} tok/s, HF {hf[-1]:.1f} tok/s, "
              f"ratio {engine[-1] / hf[-1]:.2f}", flush=True)
    ratios = [e / h for e, h in zip(engine, hf, strict=True)]
    results[f"engine_tok_s_{name}"] = statistics.median(engine)
    results[f"hf_tok_s_{name}"] = statistics.median(hf)
    results[f"ratio_{name}"] = statistics.median(ratios)
    print(f"{name}: engine {results[f'engine_tok_s_{name}']:.1f} tok/s, HF {results[f'hf_tok_s_{name}']:.1f} "
          f"tok/s, ratio {results[f'ratio_{name}']:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 long-tail requests, 32 uniform tokens")
    parser.add_argument("--reps", type=int, default=1, help="engine/HF pairs per workload (alternating)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    setup_process_env(num_threads=args.threads)
    set_torch_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(path="smollm2-135m-instruct")
    tok = load_tokenizer(cfg)
    # Each side gets its own copy: the engine turns its model's linear layers into prepacked ones.
    engine_model, hf_model = load_model(cfg, device=args.device), load_model(cfg, device=args.device)

    warm = make_requests(tok, [4, 4])
    run_engine(engine_model, tok, warm, 2)
    run_hf(hf_model, tok, warm, 2)

    results = {}
    lengths = long_tail_lengths(32 if args.quick else 64)
    results["step_bound_longtail"] = long_tail_bound(lengths)
    print(f"long-tail: {len(lengths)} requests, {sum(lengths)} useful tokens, structural bound "
          f"{results['step_bound_longtail']:.2f}x", flush=True)
    compare(results, "longtail", (engine_model, hf_model), tok, make_requests(tok, lengths), 8, args.reps)
    new_tokens = 32 if args.quick else 64
    for batch in (8, 32):
        print(f"uniform: batch {batch} x {new_tokens} new tokens", flush=True)
        compare(results, f"b{batch}", (engine_model, hf_model), tok, make_requests(tok, [new_tokens] * batch), batch,
                args.reps)
    print("RESULT " + " ".join(f"{k}={v:.2f}" if k.startswith(("ratio", "step")) else f"{k}={v:.1f}"
                               for k, v in results.items()))


if __name__ == "__main__":
    main()
