"""The trainer's stages with and without PrefixGrouper (``trainer.prefix_grouper``), same batch, same process.

One FSDP2 ``TrainerWorker`` rank (gloo, loopback) on SmolLM2-135M-Instruct, fp32, CPU. The batch is the main
job's (issue #20): ``--prompts`` prompts of the default preset's task (``smollm2-reasoning``, chat-templated as
the job does) × ``--n`` samples, responses of random token ids whose lengths are drawn with a fixed seed from
the main job's measured mix (about a third at the 32-token cap). Two workers, ``prefix_grouper`` false and
true, alternate stage by stage for ``--reps`` repetitions after one warm-up each (so both see the same machine
load): ``compute_log_prob`` (the old-log-prob forward) and ``update_actor`` (forward + backward + AdamW step on
one mini-batch). Also printed: the tokens each setting's forwards see (rows × width per micro-batch).

Final line: ``RESULT logp_s_off=… logp_s_on=… speedup_logp=… update_s_off=… update_s_on=… speedup_update=…
forward_tokens_off=… forward_tokens_on=…`` (seconds are medians; speedups the median of per-repetition ratios).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from modes_bench import MAIN_TASK, PRESET  # a script: bench/ is on sys.path

from common import schema
from common.env import set_torch_threads, setup_process_env
from common.models import load_tokenizer
from common.net import free_port
from controller.config import load_config
from controller.data import PromptDataset
from trainers import fsdp
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.worker import TrainerWorker

RESPONSE_LENGTHS = (7, 9, 12, 13, 17, 24, 32, 32, 32)  # the main job's mix at <= 32 tokens (metrics.jsonl)


def main_job_batch(preset: str, num_prompts: int, n: int, response_len: int, seed: int = 0) -> dict:
    """``num_prompts`` prompts of ``preset`` × ``n`` samples, left-padded, random responses; the main
    preset's task pinned to the recorded workload's (``modes_bench.MAIN_TASK``)."""
    cfg = load_config(preset=preset, overrides=list(MAIN_TASK) if preset == PRESET else [])
    tokenizer = load_tokenizer(cfg.model)
    train, _ = PromptDataset.splits(cfg.data, tokenizer)
    prompts = [list(p.input_ids) for p in train.prompts[:num_prompts]]
    rng = random.Random(seed)
    width, batch = max(map(len, prompts)), num_prompts * n
    ids = torch.full((batch, width), tokenizer.pad_token_id or 0, dtype=torch.int64)
    mask = torch.zeros((batch, width), dtype=torch.int64)
    vocab = len(tokenizer)
    responses = torch.randint(min(100, vocab // 2), vocab, (batch, response_len),
                              generator=torch.Generator().manual_seed(seed))
    response_mask = torch.zeros((batch, response_len), dtype=torch.int64)
    scores = torch.zeros((batch, response_len))
    for row in range(batch):
        prompt = prompts[row // n]
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
        length = min(rng.choice(RESPONSE_LENGTHS), response_len)
        response_mask[row, :length] = 1
        scores[row, length - 1] = float(rng.random() < 0.3)
    return {schema.INPUT_IDS: ids, schema.ATTENTION_MASK: mask, schema.RESPONSES: responses,
            schema.RESPONSE_MASK: response_mask, schema.TOKEN_LEVEL_SCORES: scores,
            schema.UID: [f"p{row // n}" for row in range(batch)]}


def forward_tokens(worker: TrainerWorker, batch: dict) -> int:
    """Tokens the policy's forwards see in one ``compute_log_prob`` (rows × width, summed over passes)."""
    seen: list[int] = []
    hook = worker.policy.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True)
    try:
        worker.compute_log_prob(batch)
    finally:
        hook.remove()
    return sum(seen)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per setting (default 3)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8, help="trainer.ppo_micro_batch_size")
    p.add_argument("--preset", default="smollm2-reasoning", help="model and prompts (tiny: a smoke test)")
    args = p.parse_args()
    setup_process_env()
    set_torch_threads(args.threads)
    fsdp.init_distributed(0, 1, "127.0.0.1", free_port("127.0.0.1"), "gloo", 600.0)
    batch = main_job_batch(args.preset, args.prompts, args.n, args.response_len)
    model = load_config(preset=args.preset).model
    workers = {share: TrainerWorker(TrainerConfig(ppo_mini_batch_size=args.prompts, ppo_micro_batch_size=args.micro_batch,
                                                  lr=2e-6, num_threads=args.threads, prefix_grouper=share),
                                    AlgorithmConfig(), model, temperature=1.0, max_response_length=args.response_len)
               for share in (False, True)}
    tokens = {share: forward_tokens(w, batch) for share, w in workers.items()}
    times: dict[tuple[bool, str], list[float]] = {(s, k): [] for s in workers for k in ("logp", "update")}
    for rep in range(args.reps + 1):  # the first is a warm-up
        for share, worker in workers.items():
            start = time.perf_counter()
            full = dict(batch) | worker.compute_log_prob(batch)
            logp_s = time.perf_counter() - start
            full |= worker.compute_advantages(full)[0]
            start = time.perf_counter()
            worker.update_actor(full)
            update_s = time.perf_counter() - start
            if rep:
                times[(share, "logp")].append(logp_s)
                times[(share, "update")].append(update_s)
            print(f"rep {rep}{' (warm-up)' if not rep else ''} prefix_grouper={share}: compute_log_prob "
                  f"{logp_s:.2f} s, update_actor {update_s:.2f} s", flush=True)
    result = {}
    for stage in ("logp", "update"):
        off, on = times[(False, stage)], times[(True, stage)]
        ratios = [a / b for a, b in zip(off, on, strict=True)]
        print(f"{stage}: off {statistics.median(off):.2f} s ({min(off):.2f}-{max(off):.2f}), on "
              f"{statistics.median(on):.2f} s ({min(on):.2f}-{max(on):.2f}), speedup {statistics.median(ratios):.2f}× "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
        result |= {f"{stage}_s_off": statistics.median(off), f"{stage}_s_on": statistics.median(on),
                   f"speedup_{stage}": statistics.median(ratios)}
    print(f"forward tokens per compute_log_prob: off {tokens[False]}, on {tokens[True]}")
    result |= {"forward_tokens_off": tokens[False], "forward_tokens_on": tokens[True]}
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
